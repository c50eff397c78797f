package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	imgpng "image/png"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The command as a new user meets it: moex --help names every command (bench coalesce,
// the tuning tool, and version among them); moex version says what was built; each
// bench says what it does before its flags, and no flag states its default twice; the
// main job says it started (stderr), ends with a verdict, and its JSON carries the
// command line and the machine as bench coll's does.
func TestFirstHourCLI(t *testing.T) {
	exe := moexBinary(t)
	run := func(args ...string) (string, string, error) {
		var o, e bytes.Buffer
		cmd := exec.Command(exe, args...)
		cmd.Stdout, cmd.Stderr = &o, &e
		err := cmd.Run()
		return o.String(), e.String(), err
	}

	help, _, err := run("--help")
	require.NoError(t, err)
	for _, cmd := range []string{"run", "bench coll", "bench p2p", "bench moe", "bench coalesce", "doctor", "flow", "topo", "env", "version"} {
		assert.Contains(t, help, "  moex "+cmd+" ", "moex --help lists moex %s", cmd)
	}
	version, _, err := run("version")
	require.NoError(t, err)
	assert.Regexp(t, `^moex \S+ \(commit \S+\)\nbuilt with go1\.\d+`, version)

	for _, bench := range []string{"moe", "coll", "p2p", "coalesce"} {
		_, usage, err := run("bench", bench, "-h")
		require.NoError(t, err, bench)
		first, rest, _ := strings.Cut(usage, "\n\n")
		assert.Equal(t, "usage: moex bench "+bench+" [flags]", first, "bench %s -h begins with its synopsis", bench)
		desc, _, _ := strings.Cut(rest, "\n\n")
		assert.Greater(t, len(strings.Fields(desc)), 20, "bench %s -h says what it does", bench)
		sc := bufio.NewScanner(strings.NewReader(usage))
		for sc.Scan() {
			assert.LessOrEqual(t, strings.Count(sc.Text(), "(default "), 1, "bench %s: a flag states its default twice: %q", bench, sc.Text())
		}
	}

	table, started, err := run("bench", "moe", "--model", "tiny-qwen", "--ranks", "2", "--tokens", "8", "--iters", "3")
	require.NoError(t, err, started)
	assert.Contains(t, started, "moex bench moe: tiny-qwen, 2 ranks over inproc, 8 tokens per rank", "a word on stderr as it starts")
	lines := strings.Split(strings.TrimSpace(table), "\n")
	assert.Regexp(t, `^verdict +output correct \(error `, lines[len(lines)-1], "the last line is the verdict")

	// --plot compares the run's mode with the other one (a job each): a PNG that decodes.
	png := filepath.Join(t.TempDir(), "moe.png")
	_, stderr, err := run("bench", "moe", "--model", "tiny-qwen", "--ranks", "2", "--tokens", "8", "--iters", "3", "--plot", png)
	require.NoError(t, err, stderr)
	f, err := os.Open(png)
	require.NoError(t, err)
	_, err = imgpng.Decode(f)
	f.Close()
	require.NoError(t, err)

	js, _, err := run("bench", "moe", "--model", "tiny-qwen", "--ranks", "2", "--tokens", "8", "--iters", "3", "--json")
	require.NoError(t, err)
	var res struct {
		Run struct {
			Command string `json:"command"`
			CPU     string `json:"cpu"`
			Cores   int    `json:"cores"`
			Go      string `json:"go"`
		} `json:"run"`
	}
	require.NoError(t, json.Unmarshal([]byte(strings.TrimSpace(js)), &res), js)
	assert.Equal(t, "moex bench moe --model tiny-qwen --ranks 2 --tokens 8 --iters 3 --json", res.Run.Command)
	assert.NotEmpty(t, res.Run.CPU)
	assert.Positive(t, res.Run.Cores)
	assert.True(t, strings.HasPrefix(res.Run.Go, "go1."), res.Run.Go)
}
