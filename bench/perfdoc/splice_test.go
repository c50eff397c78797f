package main

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A section run again replaces its namesake; a new one goes after the last section,
// before the run's time; the note comes last.
func TestSpliceSections(t *testing.T) {
	old := "# doc\n\nintro\n\n## A\n\nold a\n\n## B\n\nold b\n\nThe run took 1h.\n"
	fresh := "# doc\n\nintro again\n\n## B\n\nnew b\n\n## C\n\nnew c\n\n"
	got, err := spliceSections([]byte(old), []byte(fresh), "Sections B,C again.")
	require.NoError(t, err)
	assert.Equal(t, "# doc\n\nintro\n\n## A\n\nold a\n\n## B\n\nnew b\n\n## C\n\nnew c\n\nThe run took 1h.\nSections B,C again.\n", string(got))
	_, err = spliceSections([]byte("# doc\n\n## A\n\na\n"), []byte(fresh), "x")
	require.Error(t, err, "no run line to put C before")
}

// On docs/PERFORMANCE.md, splicing a section as it is changes nothing but the note.
func TestSpliceSectionsRoundTrip(t *testing.T) {
	doc, err := os.ReadFile("../../docs/PERFORMANCE.md")
	require.NoError(t, err)
	secs := sections(doc)
	require.Greater(t, len(secs), 3)
	fresh := "# moex performance\n\n" + secs[2]
	got, err := spliceSections(doc, []byte(fresh), "note")
	require.NoError(t, err)
	assert.Equal(t, strings.TrimRight(string(doc), "\n")+"\nnote\n", string(got))
}
