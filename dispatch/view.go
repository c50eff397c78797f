package dispatch

import (
	"github.com/moex-ai/moex/coll/dtype"
)

// The experts' view of a step, built the same way for every mode: a mode's rowSource
// reads the rows this rank received from its own wire format, and buildView counts them
// per local expert, lays out the expert-major entries (each expert's block padded to
// Config.Align), and fills the entries and the handle's maps (origin rows, their
// entries and weights) that the combine walks back.

// inRow is one row this rank received, as a rowSource reads it.
type inRow struct {
	q, src int       // its origin rank, and its token there
	cs     []contrib // its choices of this rank's experts, in the order of its choices
	// at is the row's index in the region the view reads in place (placeRegion): the
	// entries name it, and where the wire type is not the activations' the row is
	// decoded there.
	at  int
	pay []byte    // its payload and scales on the wire, for a view that copies or decodes
	sca []float32 // them
}

// rowSource walks the rows this rank received in a step in the view's order: origin
// ranks ascending, each origin's rows in the order it sent them.
type rowSource interface {
	// rewind starts the walk over: buildView walks twice, to count and to fill.
	rewind()
	// next reads the next row into r (r.cs reusing its storage); false at the end, or
	// with an error (ErrMismatch) where a row's metadata is out of bounds.
	next(r *inRow) (bool, error)
}

// placement is where the view's rows lie.
type placement int

const (
	// placeRegion: the rows stay in a region indexed by inRow.at (where they arrived,
	// or in their senders' memory), decoded into a region of the same shape where the
	// wire type is not the activations' (unless the experts take quantized rows).
	placeRegion placement = iota
	// placeExpertMajor: each entry's row is copied (decoded) into the entry's place, the
	// padding zeroed.
	placeExpertMajor
	// placeArrival: each incoming row is decoded at its index in arrival order (TwoLevel's
	// up stage), its entries naming it.
	placeArrival
)

// region is where placeRegion's rows lie: rows of payloads and of scales.
type region struct {
	pay, sca []byte
	rows     int
}

// buildView makes s's view of src's rows, placed as pl says (rg: placeRegion's rows).
func (s *slot) buildView(src rowSource, pl placement, rg region) error {
	d := s.d
	p, me, hid := d.c.Size(), d.c.Rank(), d.cfg.Hidden
	es := d.act.Size()
	f := &d.f
	local := s.pl.Local[me]
	v := &s.view
	packed := pl == placeRegion && d.cfg.ExpertMajor
	if packed {
		pl = placeExpertMajor // Config.ExpertMajor: copy them into their entries
	}
	v.expertMajor = pl == placeExpertMajor
	v.startCounts(len(local))
	r := &d.in
	r.cs = d.contribs()
	incomingRows, contribs := 0, 0
	for {
		more, err := src.next(r)
		if err != nil {
			return err
		}
		if !more {
			break
		}
		incomingRows++
		contribs += len(r.cs)
		for _, x := range r.cs {
			v.counts[x.le]++
		}
	}
	total := v.layoutEntries(d.cfg.Align)
	s.allocEntries(total, incomingRows, contribs)
	decoding := false
	switch {
	case pl == placeArrival:
		v.x, v.q, v.scales = s.xS.Bytes(incomingRows*hid*es), nil, nil
		decoding = true
	case pl == placeExpertMajor && d.cfg.Quantized:
		qb := s.xS.Bytes(total * (f.Payload + f.ScaleBytes()))
		v.x, v.q, v.scales = nil, qb[:total*f.Payload], dtype.FromBytes[float32](qb[total*f.Payload:])
	case pl == placeExpertMajor:
		v.x, v.q, v.scales = s.xS.Bytes(total*hid*es), nil, nil
	case d.cfg.Quantized:
		v.x, v.q, v.scales = nil, rg.pay, dtype.FromBytes[float32](rg.sca)
	case f.Wire == d.act:
		v.x, v.q, v.scales = rg.pay, nil, nil // where the rows are
	default:
		v.x, v.q, v.scales = s.xS.Bytes(rg.rows*hid*es), nil, nil
		decoding = true
	}
	s.padEntries(pl == placeExpertMajor)
	s.stats.PackedBytes = 0
	if packed {
		s.stats.PackedBytes = len(v.x) + len(v.q) + 4*len(v.scales)
	}
	fill := d.fillScratch(len(local))
	src.rewind()
	row, ci, q := 0, 0, 0
	for {
		more, _ := src.next(r) // the first walk checked every row
		if !more {
			break
		}
		for ; q <= r.q; q++ {
			s.originStart[q] = row
		}
		at := r.at
		if pl == placeArrival {
			at = row
		}
		if decoding {
			decode(f, v.x[at*hid*es:(at+1)*hid*es], d.act, r.pay, r.sca)
		}
		s.start[row] = int32(ci)
		for _, x := range r.cs {
			dst := v.offsets[x.le] + fill[x.le]
			fill[x.le]++
			switch {
			case pl != placeExpertMajor:
				v.row[dst] = int32(at)
			case d.cfg.Quantized:
				copy(v.q[dst*f.Payload:(dst+1)*f.Payload], r.pay)
				copy(v.scales[dst*f.Scales:(dst+1)*f.Scales], r.sca)
				v.row[dst] = int32(dst)
			default:
				decode(f, v.x[dst*hid*es:(dst+1)*hid*es], d.act, r.pay, r.sca)
				v.row[dst] = int32(dst)
			}
			v.origin[dst], v.source[dst], v.weight[dst] = int32(r.q), int32(r.src), x.w
			v.expert[dst] = int32(local[x.le])
			s.entries[ci], s.weights[ci] = int32(dst), x.w
			ci++
		}
		row++
	}
	for ; q <= p; q++ {
		s.originStart[q] = row
	}
	s.start[row] = int32(ci)
	return nil
}
