//go:build race

// Package race reports whether the race detector is compiled in: under it sync.Pool drops
// items on purpose, so allocation counts are meaningless.
package race

// Enabled is true when built with -race.
const Enabled = true
