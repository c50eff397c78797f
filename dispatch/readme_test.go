package dispatch_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestREADMETour: every Go block of the README marked as coming from a tested file
// (<!-- tour: path -->) is lines of that file, in order, so that the tour a new user
// pastes cannot drift from code that go test compiles and runs; and the block links
// that whole file right after it, for the lines the tour leaves out.
func TestREADMETour(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	blocks := regexp.MustCompile("(?s)<!-- tour: (\\S+)[^>]*-->\\s*```go\\n(.*?)```\\n\\s*([^\\n]*)").FindAllSubmatch(readme, -1)
	require.NotEmpty(t, blocks, "the README's tour blocks")
	for _, b := range blocks {
		assert.Contains(t, string(b[3]), "]("+string(b[1])+")", "the tour block from %s links the whole file right after it", b[1])
		src, err := os.ReadFile("../" + string(b[1]))
		require.NoError(t, err, "the tour's source")
		var lines []string
		for _, l := range strings.Split(string(src), "\n") {
			lines = append(lines, strings.TrimSpace(l))
		}
		at := 0
		for _, want := range strings.Split(string(b[2]), "\n") {
			want = strings.TrimSpace(want)
			if want == "" {
				continue
			}
			found := false
			for ; at < len(lines); at++ {
				if lines[at] == want {
					found, at = true, at+1
					break
				}
			}
			if !assert.True(t, found, "README's tour line %q is not in %s (after the lines before it)", want, b[1]) {
				break
			}
		}
	}
}
