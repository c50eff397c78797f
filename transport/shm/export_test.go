package shm

import "time"

// SetProgressNap sets how long the progress loop sleeps at most (see progressNap).
func SetProgressNap(d time.Duration) { progressNap = d }

// BreakArena makes rank peer's shared arena unmappable for t, as where pidfd_getfd is
// refused, so that t reads that peer's shared buffers across instead.
func BreakArena(t *Transport, peer int, err error) { t.peers[peer].arena.failed = err }

// SetLLC makes d take the last-level cache for llc bytes (0: unknown), which decides when
// it streams the blocks it reads in place (see footprint).
func SetLLC(d *Direct, llc int) { d.llc = llc }
