package bootstrap

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A request the store's clients send, read back as sent; anything else is an error,
// never a panic or an allocation beyond the bounds.
func FuzzStoreRequest(f *testing.F) {
	f.Add(appendBlob(appendBlob([]byte{opSet}, []byte("k")), []byte("v")))
	get := binary.LittleEndian.AppendUint32([]byte{opGet}, 2)
	get = appendBlob(appendBlob(get, []byte("a")), []byte("stage/1"))
	f.Add(get)
	claim := binary.LittleEndian.AppendUint32([]byte{opClaim}, 3)
	claim = binary.LittleEndian.AppendUint32(claim, 4)
	f.Add(appendBlob(claim, []byte("nonce")))
	f.Add([]byte{opStatus})
	f.Add(appendBlob([]byte{opScan}, []byte("join/")))
	f.Add(appendBlob([]byte{opDel}, []byte("join/2/x")))
	f.Add([]byte{opGet, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{opSet, 0xff, 0xff, 0xff, 0x7f})
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bufio.NewReader(bytes.NewReader(b))
		for {
			req, err := readRequest(r)
			if err != nil {
				return
			}
			// What was read is what a client would have sent for it.
			var enc []byte
			switch req.op {
			case opSet:
				enc = appendBlob(appendBlob([]byte{opSet}, []byte(req.key)), req.val)
				assert.LessOrEqual(t, len(req.key), maxKey)
				assert.LessOrEqual(t, len(req.val), maxVal)
			case opGet:
				enc = binary.LittleEndian.AppendUint32([]byte{opGet}, uint32(len(req.keys)))
				for _, k := range req.keys {
					enc = appendBlob(enc, []byte(k))
				}
			case opClaim:
				enc = binary.LittleEndian.AppendUint32([]byte{opClaim}, uint32(req.rank))
				enc = binary.LittleEndian.AppendUint32(enc, uint32(req.size))
				enc = appendBlob(enc, []byte(req.nonce))
			case opStatus:
				enc = []byte{opStatus}
			case opScan, opDel:
				enc = appendBlob([]byte{req.op}, []byte(req.key))
				assert.LessOrEqual(t, len(req.key), maxKey)
			default:
				t.Fatalf("readRequest returned op %q", req.op)
			}
			again, err := readRequest(bufio.NewReader(bytes.NewReader(enc)))
			require.NoError(t, err)
			assert.Equal(t, req, again)
		}
	})
}

// A store reply: status and values within their bounds, or an error.
func FuzzStoreReply(f *testing.F) {
	var ok bytes.Buffer
	require.NoError(f, writeReply(&ok, stOK, [][]byte{[]byte("0"), []byte("ready")}))
	f.Add(ok.Bytes())
	f.Add(failReply(stDup, 3, ""))
	f.Add(replyMsg(stErr, "store closed"))
	f.Add([]byte{stOK, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		st, vals, err := readReply(bufio.NewReader(bytes.NewReader(b)))
		if err != nil {
			return
		}
		var again bytes.Buffer
		require.NoError(t, writeReply(&again, st, vals))
		assert.Equal(t, b[:again.Len()], again.Bytes(), "the reply re-encodes as it came")
	})
}

// A peer that does not know the secret gets nowhere, whatever it sends: the handshake
// fails with an error (never a panic, never success) before its deadline.
