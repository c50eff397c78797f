package dispatch

import (
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/internal/memx"
)

// packer encodes each token in the wire format straight into the first row it is
// written to and copies that encoding into the token's other rows: no separate
// quantisation pass, and each token is encoded once however many ranks it goes to.
type packer struct {
	f    *Format
	act  dtype.Type
	pow2 bool
	hid  int // bytes of a token in x
	x    []byte
	loc  []tokLoc
	// The own rows staged in the wire format (stageRows): stRow bytes per token with the
	// scales at stPer.
	st           []byte
	stPer, stRow int
}

// tokLoc is where a pass put a token's encoding first.
type tokLoc struct {
	pay []byte
	sca []float32
}

func (d *core) packer() *packer {
	pk := &d.pk
	pk.f, pk.act, pk.pow2, pk.hid = &d.f, d.act, d.cfg.PowerOfTwoScales, d.cfg.Hidden*d.act.Size()
	return pk
}

// begin starts a pass over the t tokens of x.
func (pk *packer) begin(x []byte, t int) {
	pk.x = x
	if pk.f.Wire == pk.act {
		return
	}
	if cap(pk.loc) < t {
		pk.loc = make([]tokLoc, t)
	}
	pk.loc = pk.loc[:t]
	clear(pk.loc)
}

// put writes token t's payload into pay and its scales into sca; stream sends the
// payload past the caches (it is only copied, never encoded, that way).
func (pk *packer) put(t int, pay []byte, sca []float32, stream bool) {
	if pk.f.Wire == pk.act {
		copyRow(pay, pk.x[t*pk.hid:(t+1)*pk.hid], stream)
		return
	}
	if l := &pk.loc[t]; l.pay != nil {
		copyRow(pay, l.pay, stream)
		copy(sca, l.sca)
		return
	}
	encode(pk.f, pay, sca, pk.x[t*pk.hid:(t+1)*pk.hid], pk.act, pk.pow2)
	pk.loc[t] = tokLoc{pay, sca}
}

// encodeRow encodes token t of x into pay and sca.
func (pk *packer) encodeRow(t int, pay []byte, sca []float32) {
	encode(pk.f, pay, sca, pk.x[t*pk.hid:(t+1)*pk.hid], pk.act, pk.pow2)
}

func copyRow(dst, src []byte, stream bool) {
	if stream {
		memx.Stream(dst, src)
	} else {
		copy(dst, src)
	}
}

// stageRows encodes the listed tokens of x (the rows that stay on this rank) into the
// stage, at their token positions, when the wire type is not the activation type;
// token then gives a staged token's payload and scales.
func (d *core) stageRows(x []byte, t int, rows []int32) {
	pk := d.packer()
	f := pk.f
	pk.x = x
	if f.Wire == pk.act {
		return
	}
	pk.stPer = (f.Payload + 3) &^ 3
	pk.stRow = pk.stPer + f.ScaleBytes()
	pk.st = d.stage.Bytes(t * pk.stRow)
	for _, i := range rows {
		row := pk.st[int(i)*pk.stRow : (int(i)+1)*pk.stRow]
		pk.encodeRow(int(i), row[:f.Payload], dtype.FromBytes[float32](row[pk.stPer:]))
	}
}

// token returns staged token t's payload and scales.
func (pk *packer) token(t int) ([]byte, []float32) {
	if pk.f.Wire == pk.act {
		return pk.x[t*pk.hid : (t+1)*pk.hid], nil
	}
	row := pk.st[t*pk.stRow : (t+1)*pk.stRow]
	return row[:pk.f.Payload], dtype.FromBytes[float32](row[pk.stPer:])
}
