//go:build !linux

package obuf

import (
	"errors"
	"unsafe"
)

// ArenaName is the name of the shared arena's memfd.
const ArenaName = "moex-obuf"

var errNoArena = errors.New("obuf: shared buffers need Linux (memfd)")

type sharedMapping struct {
	p   unsafe.Pointer
	n   int
	off int64
}

func sharedAlloc(n int) ([]byte, int64, error) { return nil, 0, errNoArena }

func sharedFree(sharedMapping) {}

// SharedFD returns -1: there is no shared arena.
func SharedFD() int { return -1 }

// SharedErr says why shared pools hand out private buffers.
func SharedErr() error { return errNoArena }

// Locate reports false: there is no shared arena.
func Locate(p []byte) (off int64, ok bool) { return 0, false }

// ArenaFile reports false.
func ArenaFile(fd int) bool { return false }
