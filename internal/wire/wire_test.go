package wire

import (
	"bytes"
	"errors"
	"testing"
)

func sample() Header {
	return Header{Type: TypeData, Comm: 7, Src: 3, Seq: 1 << 31, Tag: 0xdeadbeef, Sig: 42,
		Length: 1 << 20, ID: 1<<63 + 5, Aux: 4096}
}

func TestRoundTrip(t *testing.T) {
	for typ := TypeHello; typ < typeEnd; typ++ {
		h := sample()
		h.Type = typ
		var b [HeaderSize]byte
		h.Encode(b[:])
		var got Header
		if err := got.Decode(b[:]); err != nil {
			t.Fatalf("%v: decode: %v", typ, err)
		}
		if got != h {
			t.Fatalf("%v: round trip: got %+v want %+v", typ, got, h)
		}
	}
}

func TestChecksum(t *testing.T) {
	payload := []byte("the quick brown fox")
	h := sample()
	h.SetChecksum(payload)
	var b [HeaderSize]byte
	h.Encode(b[:])
	var got Header
	if err := got.Decode(b[:]); err != nil {
		t.Fatal(err)
	}
	if err := got.Verify(payload); err != nil {
		t.Fatalf("verify intact payload: %v", err)
	}
	payload[3] ^= 1
	if err := got.Verify(payload); !errors.Is(err, ErrChecksum) {
		t.Fatalf("verify corrupted payload: got %v, want ErrChecksum", err)
	}
	// Without the flag nothing is checked.
	h2 := sample()
	if err := h2.Verify(payload); err != nil {
		t.Fatalf("verify without flag: %v", err)
	}
}

func TestDecodeRejects(t *testing.T) {
	good := func() []byte {
		h := sample()
		b := make([]byte, HeaderSize)
		h.Encode(b)
		return b
	}
	cases := []struct {
		name string
		mut  func([]byte) []byte
		want error
	}{
		{"short", func(b []byte) []byte { return b[:HeaderSize-1] }, ErrShort},
		{"empty", func(b []byte) []byte { return nil }, ErrShort},
		{"magic", func(b []byte) []byte { b[0] ^= 0xff; return b }, ErrMagic},
		{"version", func(b []byte) []byte { b[2] = 99; return b }, ErrVersion},
		{"type zero", func(b []byte) []byte { b[3] = 0; return b }, ErrType},
		{"type high", func(b []byte) []byte { b[3] = 200; return b }, ErrType},
		{"flags", func(b []byte) []byte { b[4] = 0x80; return b }, ErrFlags},
		{"reserved", func(b []byte) []byte { b[6] = 1; return b }, ErrReserved},
		{"reserved word", func(b []byte) []byte { b[29] = 1; return b }, ErrReserved},
		{"length", func(b []byte) []byte { b[39] = 0xff; return b }, ErrLength},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var h Header
			err := h.Decode(c.mut(good()))
			if !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("%v does not wrap ErrInvalid", err)
			}
		})
	}
}

func TestTypeString(t *testing.T) {
	if TypeRTS.String() != "rts" || Type(77).String() != "type(77)" {
		t.Fatalf("names: %q %q", TypeRTS.String(), Type(77).String())
	}
}

// FuzzDecode checks that Decode never panics and that whatever it accepts re-encodes to
// the same bytes.
func FuzzDecode(f *testing.F) {
	for typ := TypeHello; typ < typeEnd; typ++ {
		h := sample()
		h.Type = typ
		b := make([]byte, HeaderSize)
		h.Encode(b)
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte("MX"))
	f.Fuzz(func(t *testing.T, b []byte) {
		var h Header
		if err := h.Decode(b); err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		out := make([]byte, HeaderSize)
		h.Encode(out)
		if !bytes.Equal(out, b[:HeaderSize]) {
			t.Fatalf("accepted header does not re-encode identically:\n in %x\nout %x", b[:HeaderSize], out)
		}
	})
}

func BenchmarkEncodeDecode(b *testing.B) {
	h := sample()
	buf := make([]byte, HeaderSize)
	b.ReportAllocs()
	for b.Loop() {
		h.Encode(buf)
		if err := h.Decode(buf); err != nil {
			b.Fatal(err)
		}
	}
}
