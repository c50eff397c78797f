package shared

import (
	"time"

	"github.com/moex-ai/moex/internal/memx"
)

// Copying a send buffer into this rank's area: the lines written are, most of the time,
// in the caches of the ranks that took the area's previous blocks from there, and a plain
// store must first take each line from them. Where their CPUs share a cache that is
// cheap; where they do not (another core complex, as this VM's two CPUs are now and then)
// it makes the copy several times slower than the same bytes copied locally, and streaming
// stores, which take no line first, are then faster for everyone. Measured with moex
// bench coll --op alltoall --transport shm --ranks 2, 1 MiB (2 CPUs, runs of 3000 to 4000
// operations): a plain copy of a 512 KiB block into the area took 180-210 us per
// operation in the slow spells, the same op's local copy of its own block 18-20 us;
// operations took 254-301 us in those runs against 46-72 in the others, and 61-81 in
// every run streamed; streaming while the CPUs share a cache costs (62 against 84-99 us).
//
// So by default (MOEX_SHM_STREAM=auto) the copy into the area times itself against the
// operation's local copy of this rank's own block, and streams once the copy into the
// area is inStreamRatio times slower three times in a row; after inStreamFor operations it
// tries plain stores again. MOEX_SHM_STREAM=1 always streams, 0 never.
//
// Blocks far smaller than the caches pay it too: P=2, moex bench coll --transport shm,
// mean us of two runs each, copies timed from inTimedMin against from 256 KiB before:
// AllGather 256 KiB (128 KiB blocks) 11.9-16.6 against 27.5-30.1, 64 KiB 5.2-8.9
// against 8.0-8.9; AlltoAll 64 KiB 5.3-8.0 against 11.7-13.3; P=4 AllGather 256 KiB
// 40.8-43.1 against 57.5-67.4.

const (
	inTimedMin    = 16 << 10 // smaller copies stay plain and untimed
	inStreamRatio = 5
	inStreamFor   = 256
)

// copyIn is the choice between plain and streaming stores into this rank's area.
type copyIn struct {
	slow   int // operations in a row whose plain copy in was inStreamRatio times slower
	stream int // operations left to stream
}

// copier returns the copy to use for n bytes into the area, and whether to time it.
func (c *copyIn) copier(mode, n int) (cp func(dst, src []byte) int, timed bool) {
	switch {
	case mode > 0:
		return memx.Stream, false
	case mode < 0 || n < inTimedMin:
		return memx.Copy, false
	case c.stream > 0:
		c.stream--
		return memx.Stream, false
	}
	return memx.Copy, true
}

// observe records a timed plain copy into the area of in bytes that took inT, and the
// same operation's local copy of own bytes that took ownT.
func (c *copyIn) observe(in int, inT time.Duration, own int, ownT time.Duration) {
	if own <= 0 || ownT <= 0 || in <= 0 {
		return
	}
	// inT/in > ratio * ownT/own, without dividing.
	if float64(inT)*float64(own) > inStreamRatio*float64(ownT)*float64(in) {
		if c.slow++; c.slow >= 3 {
			c.slow, c.stream = 0, inStreamFor
		}
		return
	}
	c.slow = 0
}
