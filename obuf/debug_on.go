//go:build moexdebug

package obuf

import (
	"fmt"

	"github.com/cespare/xxhash/v2"
)

// Debug reports whether the expensive invariant checks are compiled in (-tags moexdebug).
const Debug = true

const poison = 0xdb

type debugState struct {
	lendSum uint64
}

// onLend remembers what the buffer held when its first in-flight send began.
func (d *debugState) onLend(b *Buf) { d.lendSum = xxhash.Sum64(b.Bytes()) }

// onReturn checks that nobody wrote to the buffer while a send was reading it.
func (d *debugState) onReturn(b *Buf) {
	if xxhash.Sum64(b.Bytes()) != d.lendSum {
		panic(fmt.Sprintf("obuf: buffer (%d bytes) was modified while a send was reading it (reuse before completion)", b.n))
	}
}

// onRelease poisons the buffer so that a write after release shows at the next Get.
func (d *debugState) onRelease(b *Buf) {
	for i := range b.b {
		b.b[i] = poison
	}
}

// onGet checks the poison laid at release.
func (d *debugState) onGet(b *Buf) {
	for i, c := range b.b {
		if c != poison {
			panic(fmt.Sprintf("obuf: buffer written at offset %d after it was released (use after release)", i))
		}
	}
}
