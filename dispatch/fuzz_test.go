package dispatch

import (
	"encoding/binary"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A row's metadata from the wire: read within its bounds (at most k choices, local
// experts below nLocal, never past meta's end), or refused; never a panic.
func FuzzGetMeta(f *testing.F) {
	row := func(src int, les ...int) []byte {
		b := binary.LittleEndian.AppendUint32(nil, uint32(src))
		b = binary.LittleEndian.AppendUint32(b, uint32(len(les)))
		for _, le := range les {
			b = binary.LittleEndian.AppendUint32(b, uint32(le))
			b = binary.LittleEndian.AppendUint32(b, math.Float32bits(0.5))
		}
		return b
	}
	f.Add(row(3, 0, 1), uint8(8), uint8(4))
	f.Add(row(0), uint8(2), uint8(2))
	f.Add(row(7, 9), uint8(8), uint8(4))
	f.Add(append(row(1, 0), 0xff), uint8(1), uint8(1))
	f.Add([]byte{1, 2, 3}, uint8(2), uint8(2))
	f.Fuzz(func(t *testing.T, meta []byte, k, nLocal uint8) {
		src, cs, n, ok := getMeta(meta, int(k), int(nLocal), nil)
		if !ok {
			return
		}
		require.LessOrEqual(t, n, len(meta))
		assert.Equal(t, 8+8*len(cs), n)
		assert.LessOrEqual(t, len(cs), int(k))
		assert.GreaterOrEqual(t, src, 0)
		for _, c := range cs {
			assert.True(t, c.le >= 0 && c.le < int(nLocal), "local expert %d of %d", c.le, nLocal)
		}
	})
}

// A block header reads back as written.
func FuzzBlockHeader(f *testing.F) {
	f.Add(uint32(0), uint32(128), uint64(0xfeed), uint64(7), uint64(1))
	f.Fuzz(func(t *testing.T, status, rows uint32, fp, gen, flags uint64) {
		b := make([]byte, blockHeader)
		want := header{status: int(status), rows: int(rows), fp: fp, gen: gen, flags: flags}
		want.put(b)
		assert.Equal(t, want, readHeader(b))
	})
}
