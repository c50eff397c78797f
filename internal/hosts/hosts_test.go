package hosts

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// Ranks on hosts named out of order and interleaved: hosts are numbered as they first
// appear, and each rank's place is its order among its host's ranks.
func TestGroup(t *testing.T) {
	hostOf, local, members := Group([]int{42, 7, 42, 9, 7, 42})
	assert.Equal(t, []int{0, 1, 0, 2, 1, 0}, hostOf)
	assert.Equal(t, []int{0, 0, 1, 0, 1, 2}, local)
	assert.Equal(t, [][]int{{0, 2, 5}, {1, 4}, {3}}, members)

	hostOf, local, members = Group(nil)
	assert.Empty(t, hostOf)
	assert.Empty(t, local)
	assert.Empty(t, members)
}
