package algos

// Planners, one per (op, algorithm). Each returns the schedule for rank sh.rank of sh.p.
// Conventions: the executor has already placed this rank's input where the plan expects
// it (AllReduce, Broadcast, Reduce: in recv; AllGather: this rank's block of recv); every
// transfer is posted even when empty, so that every pair of ranks that talks in an op
// checks the op's signature; tags are step numbers.

import (
	"github.com/moex-ai/moex/coll/dtype"
)

// ---- AllReduce ----

func PlanAllReduceRing(sh Shape) *Plan {
	pl := &Plan{Op: OpAllReduce, Algo: Ring}
	if sh.P == 1 {
		pl.add(step{Post: []Local{{Kind: LFinish, Dst: Region{bRecv, 0, sh.Count * sh.Es}}}})
		return pl
	}
	all := make([]int, sh.P)
	for i := range all {
		all[i] = i
	}
	tag := uint32(0)
	off, cnt := ringReduceScatter(pl, all, sh.Rank, 0, sh.Count, sh.Es, true, &tag)
	ringAllGather(pl, all, sh.Rank, off, cnt, sh.Es, &tag)
	return pl
}

// ringReduceScatter appends a ring reduce-scatter among members (comm ranks; this rank
// is members[me]) of the elements [first, first+count) of recv, cut into len(members)
// chunks: after it, members[i] holds chunk (i+1) mod len(members) reduced over all of
// them (finished when finish is set). It returns the chunks' element offsets (in recv)
// and counts.
func ringReduceScatter(pl *Plan, members []int, me, first, count, es int, finish bool, tag *uint32) (off, cnt []int) {
	m := len(members)
	if m == 1 {
		if finish {
			pl.add(step{Post: []Local{{Kind: LFinish, Dst: Region{bRecv, first * es, count * es}}}})
		}
		return []int{first}, []int{count}
	}
	boff, blen := split(count, m, es)
	off, cnt = make([]int, m), make([]int, m)
	for i := range boff {
		off[i], cnt[i] = first+boff[i]/es, blen[i]/es
		pl.Tmp = max(pl.Tmp, blen[i])
	}
	reg := func(i int) Region { return Region{bRecv, off[i] * es, cnt[i] * es} }
	next, prev := members[mod(me+1, m)], members[mod(me-1, m)]
	for k := 0; k < m-1; k++ {
		si, ri := mod(me-k, m), mod(me-k-1, m)
		tmp := Region{BTmp, 0, cnt[ri] * es}
		s := step{
			Sends: []Xfer{{next, *tag, reg(si)}},
			Recvs: []Xfer{{prev, *tag, tmp}},
			Post:  []Local{{Kind: LReduce, Dst: reg(ri), Src: tmp}},
		}
		if finish && k == m-2 {
			s.Post = append(s.Post, Local{Kind: LFinish, Dst: reg(ri)})
		}
		pl.add(s)
		*tag++
	}
	return off, cnt
}

// ringAllGather appends the ring all-gather that follows ringReduceScatter: members[i]
// starts with chunk (i+1) mod len(members), every member ends with all of them.
func ringAllGather(pl *Plan, members []int, me int, off, cnt []int, es int, tag *uint32) {
	m := len(members)
	reg := func(i int) Region { return Region{bRecv, off[i] * es, cnt[i] * es} }
	next, prev := members[mod(me+1, m)], members[mod(me-1, m)]
	for k := 0; k < m-1; k++ {
		si, ri := mod(me+1-k, m), mod(me-k, m)
		pl.add(step{
			Sends: []Xfer{{next, *tag, reg(si)}},
			Recvs: []Xfer{{prev, *tag, reg(ri)}},
		})
		*tag++
	}
}

// planAllReduceHier is the two-level AllReduce for ranks on several hosts: a ring
// reduce-scatter among the ranks of each host, then a ring AllReduce of each rank's chunk
// among the ranks with the same local index on every host (all of a host's ranks use
// the network at once, each for 1/m of the data), then a ring all-gather within each host.
// Only 2(H-1) of its steps cross hosts, against 2(P-1) for a flat ring, and a rank order
// that alternates hosts cannot turn every ring hop into a network hop. Hosts with unequal
// numbers of ranks get the flat ring.
func PlanAllReduceHier(sh Shape, t Topology) *Plan {
	if pl := flatUnlessUniform(t, sh, PlanAllReduceRing); pl != nil {
		return pl
	}
	pl := &Plan{Op: OpAllReduce, Algo: Hier}
	host, li := t.HostOf[sh.Rank], t.local[sh.Rank]
	home := t.Members[host]
	across := make([]int, len(t.Members))
	for h, ms := range t.Members {
		across[h] = ms[li]
	}
	m := len(home)
	tag := uint32(0)
	first, count := 0, sh.Count
	var off, cnt []int
	if m > 1 {
		off, cnt = ringReduceScatter(pl, home, li, 0, sh.Count, sh.Es, false, &tag)
		c := mod(li+1, m)
		first, count = off[c], cnt[c]
	}
	xoff, xcnt := ringReduceScatter(pl, across, host, first, count, sh.Es, true, &tag)
	ringAllGather(pl, across, host, xoff, xcnt, sh.Es, &tag)
	if m > 1 {
		ringAllGather(pl, home, li, off, cnt, sh.Es, &tag)
	}
	return pl
}

// foldPow2 handles sizes that are not a power of two for the recursive algorithms: the
// first 2*rem ranks pair up, even ones hand their data to their odd neighbour and sit out.
// It returns the rank's index among the pof2 active ranks (-1 when sitting out) and the
// real rank of an active index.
func foldPow2(p, r int) (pof2, rem, newRank int, real func(int) int) {
	pof2 = floorPow2(p)
	rem = p - pof2
	switch {
	case r < 2*rem && r%2 == 0:
		newRank = -1
	case r < 2*rem:
		newRank = r / 2
	default:
		newRank = r - rem
	}
	real = func(nr int) int {
		if nr < rem {
			return 2*nr + 1
		}
		return nr + rem
	}
	return
}

func planAllReduceRecDbl(sh Shape, algo Algo) *Plan {
	p, r := sh.P, sh.Rank
	n := sh.Count * sh.Es
	pl := &Plan{Op: OpAllReduce, Algo: algo, Tmp: n}
	all := Region{bRecv, 0, n}
	tmpAll := Region{BTmp, 0, n}
	pof2, rem, nr, real := foldPow2(p, r)
	tag := uint32(0)
	if rem > 0 {
		switch {
		case r < 2*rem && r%2 == 0:
			pl.add(step{Sends: []Xfer{{r + 1, tag, all}}})
		case r < 2*rem:
			pl.add(step{Recvs: []Xfer{{r - 1, tag, tmpAll}}, Post: []Local{{Kind: LReduce, Dst: all, Src: tmpAll}}})
		default:
			pl.add(step{})
		}
		tag++
	}
	if nr >= 0 {
		if algo == Rabenseifner && pof2 > 1 {
			rabenseifnerCore(pl, sh, nr, pof2, real, &tag)
		} else {
			for mask := 1; mask < pof2; mask <<= 1 {
				peer := real(nr ^ mask)
				pl.add(step{
					Sends: []Xfer{{peer, tag, all}},
					Recvs: []Xfer{{peer, tag, tmpAll}},
					Post:  []Local{{Kind: LReduce, Dst: all, Src: tmpAll}},
				})
				tag++
			}
			pl.add(step{Post: []Local{{Kind: LFinish, Dst: all}}})
		}
	}
	if rem > 0 {
		switch {
		case r < 2*rem && r%2 == 0:
			pl.add(step{Recvs: []Xfer{{r + 1, 1000, all}}})
		case r < 2*rem:
			pl.add(step{Sends: []Xfer{{r - 1, 1000, all}}})
		}
	}
	return pl
}

// rabenseifnerCore: reduce-scatter by recursive halving, then all-gather by recursive
// doubling, among pof2 active ranks; active rank nr ends the first phase owning chunk nr.
func rabenseifnerCore(pl *Plan, sh Shape, nr, pof2 int, real func(int) int, tag *uint32) {
	off, ln := split(sh.Count, pof2, sh.Es)
	span := func(lo, hi int) Region {
		if lo >= hi {
			return Region{bRecv, 0, 0}
		}
		return Region{bRecv, off[lo], off[hi-1] + ln[hi-1] - off[lo]}
	}
	lo, hi := 0, pof2
	type win struct{ lo, hi int }
	var wins []win
	for mask := pof2 / 2; mask >= 1; mask >>= 1 {
		peer := real(nr ^ mask)
		mid := (lo + hi) / 2
		keep, give := win{lo, mid}, win{mid, hi}
		if nr&mask != 0 {
			keep, give = give, keep
		}
		k := span(keep.lo, keep.hi)
		pl.add(step{
			Sends: []Xfer{{peer, *tag, span(give.lo, give.hi)}},
			Recvs: []Xfer{{peer, *tag, Region{BTmp, 0, k.N}}},
			Post:  []Local{{Kind: LReduce, Dst: k, Src: Region{BTmp, 0, k.N}}},
		})
		*tag++
		wins = append(wins, win{lo, hi})
		lo, hi = keep.lo, keep.hi
	}
	pl.add(step{Post: []Local{{Kind: LFinish, Dst: span(lo, hi)}}})
	for mask := 1; mask < pof2; mask <<= 1 {
		peer := real(nr ^ mask)
		outer := wins[len(wins)-1]
		wins = wins[:len(wins)-1]
		mine := span(lo, hi)
		var theirs Region
		if lo == outer.lo {
			theirs = span(hi, outer.hi)
		} else {
			theirs = span(outer.lo, lo)
		}
		pl.add(step{
			Sends: []Xfer{{peer, *tag, mine}},
			Recvs: []Xfer{{peer, *tag, theirs}},
		})
		*tag++
		lo, hi = outer.lo, outer.hi
	}
}

// ---- Broadcast, Reduce ----

func planBroadcastBinomial(sh Shape) *Plan {
	p, r := sh.P, sh.Rank
	all := Region{bRecv, 0, sh.Count * sh.Es}
	pl := &Plan{Op: OpBroadcast, Algo: Binomial}
	vr := mod(r-sh.Root, p)
	real := func(v int) int { return mod(v+sh.Root, p) }
	tag := uint32(0)
	for mask := 1; mask < p; mask <<= 1 {
		var s step
		switch {
		case vr < mask && vr+mask < p:
			s.Sends = []Xfer{{real(vr + mask), tag, all}}
		case vr >= mask && vr < 2*mask:
			s.Recvs = []Xfer{{real(vr - mask), tag, all}}
		}
		pl.add(s)
		tag++
	}
	return pl
}

func planBroadcastLinear(sh Shape) *Plan {
	all := Region{bRecv, 0, sh.Count * sh.Es}
	pl := &Plan{Op: OpBroadcast, Algo: Linear}
	var s step
	if sh.Rank == sh.Root {
		for q := 0; q < sh.P; q++ {
			if q != sh.Root {
				s.Sends = append(s.Sends, Xfer{q, 0, all})
			}
		}
	} else {
		s.Recvs = []Xfer{{sh.Root, 0, all}}
	}
	pl.add(s)
	return pl
}

func planReduceBinomial(sh Shape) *Plan {
	p, r := sh.P, sh.Rank
	n := sh.Count * sh.Es
	all := Region{bRecv, 0, n}
	tmp := Region{BTmp, 0, n}
	pl := &Plan{Op: OpReduce, Algo: Binomial, Tmp: n}
	vr := mod(r-sh.Root, p)
	real := func(v int) int { return mod(v+sh.Root, p) }
	tag := uint32(0)
	for mask := 1; mask < p; mask <<= 1 {
		var s step
		switch {
		case vr&(2*mask-1) == mask:
			s.Sends = []Xfer{{real(vr - mask), tag, all}}
		case vr&(2*mask-1) == 0 && vr+mask < p:
			s.Recvs = []Xfer{{real(vr + mask), tag, tmp}}
			s.Post = []Local{{Kind: LReduce, Dst: all, Src: tmp}}
		}
		pl.add(s)
		tag++
	}
	if r == sh.Root {
		pl.add(step{Post: []Local{{Kind: LFinish, Dst: all}}})
	}
	return pl
}

func planReduceLinear(sh Shape) *Plan {
	n := sh.Count * sh.Es
	all := Region{bRecv, 0, n}
	pl := &Plan{Op: OpReduce, Algo: Linear}
	if sh.Rank != sh.Root {
		pl.add(step{Sends: []Xfer{{sh.Root, 0, all}}})
		return pl
	}
	// The root receives every contribution, then reduces in rank order.
	pl.Tmp = n * (sh.P - 1)
	var s step
	j := 0
	for q := 0; q < sh.P; q++ {
		if q == sh.Root {
			continue
		}
		t := Region{BTmp, j * n, n}
		s.Recvs = append(s.Recvs, Xfer{q, 0, t})
		s.Post = append(s.Post, Local{Kind: LReduce, Dst: all, Src: t})
		j++
	}
	s.Post = append(s.Post, Local{Kind: LFinish, Dst: all})
	pl.add(s)
	return pl
}

// ---- AllGather (count = elements per rank) ----

// planAllGatherShared: every rank publishes its block (in place in recv) in its shared
// area, or for the others to read across, and takes everyone else's (coll/shared).
func planAllGatherShared(sh Shape) *Plan {
	p := sh.P
	v := &VLayout{RecvOff: make([]int, p), RecvLen: make([]int, p), SrcOff: make([]int, p), SrcLen: make([]int, p)}
	for q := 0; q < p; q++ {
		r := sh.blk(bRecv, q)
		v.RecvOff[q], v.RecvLen[q], v.SrcLen[q] = r.Off, r.N, r.N
	}
	return &Plan{Op: OpAllGather, Algo: Shared, Shared: v}
}

func PlanAllGatherRing(sh Shape) *Plan {
	p, r := sh.P, sh.Rank
	pl := &Plan{Op: OpAllGather, Algo: Ring}
	next, prev := mod(r+1, p), mod(r-1, p)
	for k := 0; k < p-1; k++ {
		pl.add(step{
			Sends: []Xfer{{next, uint32(k), sh.blk(bRecv, mod(r-k, p))}},
			Recvs: []Xfer{{prev, uint32(k), sh.blk(bRecv, mod(r-k-1, p))}},
		})
	}
	return pl
}

// planAllGatherRecDbl exchanges ranges of blocks that double each step; with a
// non-power-of-two of ranks, or blocks not packed in rank order, it runs Bruck's.
func planAllGatherRecDbl(sh Shape) *Plan {
	p, r := sh.P, sh.Rank
	if !isPow2(p) || !sh.packed() {
		pl := PlanAllGatherBruck(sh)
		pl.Algo = RecDoubling
		return pl
	}
	pl := &Plan{Op: OpAllGather, Algo: RecDoubling}
	tag := uint32(0)
	for mask := 1; mask < p; mask <<= 1 {
		peer := r ^ mask
		mine, theirs := r&^(mask-1), peer&^(mask-1)
		pl.add(step{
			Sends: []Xfer{{peer, tag, sh.span(bRecv, mine, mine+mask)}},
			Recvs: []Xfer{{peer, tag, sh.span(bRecv, theirs, theirs+mask)}},
		})
		tag++
	}
	return pl
}

// planAllGatherBruck works for any size in ceil(log2 p) steps: blocks accumulate in a
// rotated scratch layout (position i holds rank r+i's block), rotated back at the end.
func PlanAllGatherBruck(sh Shape) *Plan {
	p, r := sh.P, sh.Rank
	// at[i] is where position i starts in the scratch; at[p] its size.
	at := make([]int, p+1)
	for i := 0; i < p; i++ {
		at[i+1] = at[i] + sh.blk(bRecv, mod(r+i, p)).N
	}
	pl := &Plan{Op: OpAllGather, Algo: Bruck, Tmp: at[p]}
	t := func(i, k int) Region { return Region{BTmp, at[i], at[i+k] - at[i]} }
	pl.add(step{Pre: []Local{{Kind: LCopy, Dst: t(0, 1), Src: sh.blk(bRecv, r)}}})
	tag := uint32(0)
	for have := 1; have < p; have *= 2 {
		k := min(have, p-have)
		pl.add(step{
			Sends: []Xfer{{mod(r-have, p), tag, t(0, k)}},
			Recvs: []Xfer{{mod(r+have, p), tag, t(have, k)}},
		})
		tag++
	}
	var last step
	for i := 0; i < p; i++ {
		last.Post = append(last.Post, Local{Kind: LCopy, Dst: sh.blk(bRecv, mod(r+i, p)), Src: t(i, 1)})
	}
	pl.add(last)
	return pl
}

// ---- ReduceScatter (count = elements per rank; input: every rank's block in send) ----

func PlanReduceScatterRing(sh Shape) *Plan {
	p, r := sh.P, sh.Rank
	total := sh.total()
	work := func(i int) Region { return sh.blk(BTmp, i) }
	pl := &Plan{Op: OpReduceScatter, Algo: Ring, Tmp: total + sh.biggest()}
	pl.add(step{Pre: []Local{{Kind: LCopy, Dst: Region{BTmp, 0, total}, Src: Region{bSend, 0, total}}}})
	next, prev := mod(r+1, p), mod(r-1, p)
	for k := 0; k < p-1; k++ {
		si, ri := mod(r-k-1, p), mod(r-k-2, p)
		in := Region{BTmp, total, work(ri).N}
		pl.add(step{
			Sends: []Xfer{{next, uint32(k), work(si)}},
			Recvs: []Xfer{{prev, uint32(k), in}},
			Post:  []Local{{Kind: LReduce, Dst: work(ri), Src: in}},
		})
	}
	out := Region{bRecv, 0, work(r).N}
	pl.add(step{Post: []Local{{Kind: LCopy, Dst: out, Src: work(r)}, {Kind: LFinish, Dst: out}}})
	return pl
}

func planReduceScatterRecHalving(sh Shape) *Plan {
	p, r := sh.P, sh.Rank
	if !isPow2(p) {
		pl := PlanReduceScatterRing(sh)
		pl.Algo = RecHalving
		return pl
	}
	total := sh.total()
	pl := &Plan{Op: OpReduceScatter, Algo: RecHalving, Tmp: 2 * total}
	work := func(lo, hi int) Region { return sh.span(BTmp, lo, hi) }
	pl.add(step{Pre: []Local{{Kind: LCopy, Dst: work(0, p), Src: Region{bSend, 0, total}}}})
	lo, hi := 0, p
	tag := uint32(0)
	for mask := p / 2; mask >= 1; mask >>= 1 {
		peer := r ^ mask
		mid := (lo + hi) / 2
		klo, khi, glo, ghi := lo, mid, mid, hi
		if r&mask != 0 {
			klo, khi, glo, ghi = mid, hi, lo, mid
		}
		in := Region{BTmp, total, work(klo, khi).N}
		pl.add(step{
			Sends: []Xfer{{peer, tag, work(glo, ghi)}},
			Recvs: []Xfer{{peer, tag, in}},
			Post:  []Local{{Kind: LReduce, Dst: work(klo, khi), Src: in}},
		})
		tag++
		lo, hi = klo, khi
	}
	out := Region{bRecv, 0, work(r, r+1).N}
	pl.add(step{Post: []Local{{Kind: LCopy, Dst: out, Src: work(r, r+1)}, {Kind: LFinish, Dst: out}}})
	return pl
}

// ---- AlltoAll(v) ----

// vlayout is an AlltoAllv layout in bytes: what this rank sends to and receives from
// each peer.
type Vlayout struct {
	SendOff, SendLen []int
	RecvOff, RecvLen []int
}

func EvenLayout(p, b int) Vlayout {
	l := Vlayout{make([]int, p), make([]int, p), make([]int, p), make([]int, p)}
	for i := 0; i < p; i++ {
		l.SendOff[i], l.SendLen[i], l.RecvOff[i], l.RecvLen[i] = i*b, b, i*b, b
	}
	return l
}

// stepAt returns step i of pl, emptied, reusing the storage of an earlier plan built into
// pl (AlltoAllv plans are rebuilt per call without allocating).
func (pl *Plan) stepAt(i int) *step {
	if i >= len(pl.Steps) {
		if i < cap(pl.Steps) {
			pl.Steps = pl.Steps[:i+1]
		} else {
			pl.Steps = append(pl.Steps, step{})
		}
	}
	s := &pl.Steps[i]
	s.Pre, s.Recvs, s.Sends, s.Mid, s.Post = s.Pre[:0], s.Recvs[:0], s.Sends[:0], s.Mid[:0], s.Post[:0]
	return s
}

func PlanAlltoAllLinear(pl *Plan, p, r int, l Vlayout) {
	pl.Steps = pl.Steps[:0]
	s := pl.stepAt(0)
	// Our own block is copied while the transfers are under way.
	s.Mid = append(s.Mid, Local{Kind: LCopy, Dst: Region{bRecv, l.RecvOff[r], l.RecvLen[r]}, Src: Region{bSend, l.SendOff[r], l.SendLen[r]}})
	for k := 1; k < p; k++ {
		from, to := mod(r-k, p), mod(r+k, p)
		s.Recvs = append(s.Recvs, Xfer{from, 0, Region{bRecv, l.RecvOff[from], l.RecvLen[from]}})
		s.Sends = append(s.Sends, Xfer{to, 0, Region{bSend, l.SendOff[to], l.SendLen[to]}})
	}
}

func PlanAlltoAllPairwise(pl *Plan, p, r int, l Vlayout) {
	pl.Steps = pl.Steps[:0]
	for k := 1; k < p; k++ {
		from, to := mod(r-k, p), mod(r+k, p)
		s := pl.stepAt(k - 1)
		if k == 1 { // our own block, while the first exchange is under way
			s.Mid = append(s.Mid, Local{Kind: LCopy, Dst: Region{bRecv, l.RecvOff[r], l.RecvLen[r]}, Src: Region{bSend, l.SendOff[r], l.SendLen[r]}})
		}
		s.Recvs = append(s.Recvs, Xfer{from, uint32(k), Region{bRecv, l.RecvOff[from], l.RecvLen[from]}})
		s.Sends = append(s.Sends, Xfer{to, uint32(k), Region{bSend, l.SendOff[to], l.SendLen[to]}})
	}
	if p == 1 {
		s := pl.stepAt(0)
		s.Pre = append(s.Pre, Local{Kind: LCopy, Dst: Region{bRecv, l.RecvOff[r], l.RecvLen[r]}, Src: Region{bSend, l.SendOff[r], l.SendLen[r]}})
	}
}

// planAlltoAllBruck: log2(p) steps of larger messages, for small blocks. Block sizes are
// given by the full count matrix c[src][dst] in bytes (every rank knows it). Scratch holds
// p slots of the largest block (the rotated working layout) and two packing areas.
func PlanAlltoAllBruck(pl *Plan, p, r int, l Vlayout, c [][]int) {
	maxb := 0
	for _, row := range c {
		for _, v := range row {
			maxb = max(maxb, v)
		}
	}
	half := (p + 1) / 2
	slot := func(i, n int) Region { return Region{BTmp, i * maxb, n} }
	packOff, unpackOff := p*maxb, p*maxb+half*maxb
	pl.Tmp = p*maxb + 2*half*maxb
	// Phase 1: slot i holds the block for rank r+i.
	var first step
	for i := 0; i < p; i++ {
		d := mod(r+i, p)
		first.Pre = append(first.Pre, Local{Kind: LCopy, Dst: slot(i, l.SendLen[d]), Src: Region{bSend, l.SendOff[d], l.SendLen[d]}})
	}
	pl.add(first)
	// size of slot i at rank q before the step with bit pof: it came from q - (i & (pof-1)).
	size := func(q, i, pof int) int {
		src := mod(q-(i&(pof-1)), p)
		return c[src][mod(src+i, p)]
	}
	tag := uint32(0)
	for pof := 1; pof < p; pof <<= 1 {
		var s step
		to, from := mod(r+pof, p), mod(r-pof, p)
		po, uo := packOff, unpackOff
		for i := 1; i < p; i++ {
			if i&pof == 0 {
				continue
			}
			n := size(r, i, pof)
			s.Pre = append(s.Pre, Local{Kind: LCopy, Dst: Region{BTmp, po, n}, Src: slot(i, n)})
			po += n
			m := size(from, i, pof)
			s.Post = append(s.Post, Local{Kind: LCopy, Dst: slot(i, m), Src: Region{BTmp, uo, m}})
			uo += m
		}
		s.Sends = []Xfer{{to, tag, Region{BTmp, packOff, po - packOff}}}
		s.Recvs = []Xfer{{from, tag, Region{BTmp, unpackOff, uo - unpackOff}}}
		pl.add(s)
		tag++
	}
	// Phase 3: what came from rank j sits in slot r-j.
	var last step
	for j := 0; j < p; j++ {
		last.Post = append(last.Post, Local{Kind: LCopy, Dst: Region{bRecv, l.RecvOff[j], l.RecvLen[j]}, Src: slot(mod(r-j, p), l.RecvLen[j])})
	}
	pl.add(last)
}

// ---- Scatter, Gather (count = elements per rank), Barrier ----

func PlanScatterLinear(sh Shape) *Plan {
	pl := &Plan{Op: OpScatter, Algo: Linear}
	var s step
	if sh.Rank == sh.Root {
		mine := sh.blk(bSend, sh.Root)
		s.Pre = []Local{{Kind: LCopy, Dst: Region{bRecv, 0, mine.N}, Src: mine}}
		for q := 0; q < sh.P; q++ {
			if q != sh.Root {
				s.Sends = append(s.Sends, Xfer{q, 0, sh.blk(bSend, q)})
			}
		}
	} else {
		s.Recvs = []Xfer{{sh.Root, 0, Region{bRecv, 0, sh.blk(bRecv, sh.Rank).N}}}
	}
	pl.add(s)
	return pl
}

func PlanGatherLinear(sh Shape) *Plan {
	pl := &Plan{Op: OpGather, Algo: Linear}
	var s step
	if sh.Rank == sh.Root {
		mine := sh.blk(bRecv, sh.Root)
		s.Pre = []Local{{Kind: LCopy, Dst: mine, Src: Region{bSend, 0, mine.N}}}
		for q := 0; q < sh.P; q++ {
			if q != sh.Root {
				s.Recvs = append(s.Recvs, Xfer{q, 0, sh.blk(bRecv, q)})
			}
		}
	} else {
		s.Sends = []Xfer{{sh.Root, 0, Region{bSend, 0, sh.blk(bSend, sh.Rank).N}}}
	}
	pl.add(s)
	return pl
}

func planBarrier(sh Shape) *Plan {
	pl := &Plan{Op: OpBarrier, Algo: Dissemination}
	for k, d := 0, 1; d < sh.P; k, d = k+1, d*2 {
		pl.add(step{
			Sends: []Xfer{{mod(sh.Rank+d, sh.P), uint32(k), Region{bRecv, 0, 0}}},
			Recvs: []Xfer{{mod(sh.Rank-d, sh.P), uint32(k), Region{bRecv, 0, 0}}},
		})
	}
	return pl
}

// ---- hierarchical AllGather and ReduceScatter ----

// flatUnlessUniform returns the flat plan, labelled hier, when hosts hold unequal numbers
// of ranks (or there is one host); nil when the hierarchical plan applies.
func flatUnlessUniform(t Topology, sh Shape, flat func(Shape) *Plan) *Plan {
	if t.Uniform {
		return nil
	}
	pl := flat(sh)
	pl.Algo = Hier
	return pl
}

// hierView is one rank's view of a uniform topology, for the hierarchical planners.
type hierView struct {
	host, li int     // this rank's host index and index within the host
	groups   [][]int // group j: the ranks with local index j, in host order
	across   []int   // this rank's group (one rank per host)
	home     []int   // the ranks of this rank's host
	h, m     int     // hosts, ranks per host
}

func newHierView(t Topology, rank int) hierView {
	v := hierView{host: t.HostOf[rank], li: t.local[rank], h: len(t.Members), m: len(t.Members[0])}
	v.groups = make([][]int, v.m)
	for j := range v.groups {
		v.groups[j] = make([]int, v.h)
		for h, ms := range t.Members {
			v.groups[j][h] = ms[j]
		}
	}
	v.across, v.home = v.groups[v.li], t.Members[v.host]
	return v
}

// planAllGatherHier: a ring all-gather among the ranks with this rank's local index (one
// on each host: every rank crosses hosts H-1 times, for one block each), then a ring
// all-gather within the host of what each gathered (a group of H blocks per step). A
// flat ring over ranks that alternate hosts crosses at every one of its P-1 steps. Hosts
// with unequal numbers of ranks get the flat ring.
func PlanAllGatherHier(sh Shape, t Topology) *Plan {
	if pl := flatUnlessUniform(t, sh, PlanAllGatherRing); pl != nil {
		return pl
	}
	blk := func(q int) Region { return sh.blk(bRecv, q) }
	pl := &Plan{Op: OpAllGather, Algo: Hier}
	v := newHierView(t, sh.Rank)
	host, li, groups, across, home, h, m := v.host, v.li, v.groups, v.across, v.home, v.h, v.m
	tag := uint32(0)
	next, prev := across[mod(host+1, h)], across[mod(host-1, h)]
	for k := 0; k < h-1; k++ {
		pl.add(step{
			Sends: []Xfer{{next, tag, blk(across[mod(host-k, h)])}},
			Recvs: []Xfer{{prev, tag, blk(across[mod(host-k-1, h)])}},
		})
		tag++
	}
	next, prev = home[mod(li+1, m)], home[mod(li-1, m)]
	for k := 0; k < m-1; k++ {
		var s step
		sg, rg := groups[mod(li-k, m)], groups[mod(li-k-1, m)]
		for i := 0; i < h; i++ {
			s.Sends = append(s.Sends, Xfer{next, tag, blk(sg[i])})
			s.Recvs = append(s.Recvs, Xfer{prev, tag, blk(rg[i])})
			tag++
		}
		pl.add(s)
	}
	return pl
}

// planReduceScatterHier: a ring reduce-scatter within the host over groups of H blocks
// (after it, the rank with local index j holds group j summed over its host), then a ring
// reduce-scatter of that group among the ranks with local index j, one per host (each
// crosses hosts H-1 times, for one block each). Hosts with unequal numbers of ranks get
// the flat ring.
func PlanReduceScatterHier(sh Shape, t Topology) *Plan {
	if pl := flatUnlessUniform(t, sh, PlanReduceScatterRing); pl != nil {
		return pl
	}
	total, big := sh.total(), sh.biggest()
	v := newHierView(t, sh.Rank)
	host, li, groups, across, home, h, m := v.host, v.li, v.groups, v.across, v.home, v.h, v.m
	work := func(q int) Region { return sh.blk(BTmp, q) }
	in := func(i, q int) Region { return Region{BTmp, total + i*big, work(q).N} } // slot i, for rank q's block
	pl := &Plan{Op: OpReduceScatter, Algo: Hier, Tmp: total + h*big}
	pl.add(step{Pre: []Local{{Kind: LCopy, Dst: Region{BTmp, 0, total}, Src: Region{bSend, 0, total}}}})
	tag := uint32(0)
	next, prev := home[mod(li+1, m)], home[mod(li-1, m)]
	for k := 0; k < m-1; k++ {
		var s step
		sg, rg := groups[mod(li-k-1, m)], groups[mod(li-k-2, m)]
		for i := 0; i < h; i++ {
			s.Sends = append(s.Sends, Xfer{next, tag, work(sg[i])})
			s.Recvs = append(s.Recvs, Xfer{prev, tag, in(i, rg[i])})
			s.Post = append(s.Post, Local{Kind: LReduce, Dst: work(rg[i]), Src: in(i, rg[i])})
			tag++
		}
		pl.add(s)
	}
	next, prev = across[mod(host+1, h)], across[mod(host-1, h)]
	for k := 0; k < h-1; k++ {
		si, ri := mod(host-k-1, h), mod(host-k-2, h)
		pl.add(step{
			Sends: []Xfer{{next, tag, work(across[si])}},
			Recvs: []Xfer{{prev, tag, in(0, across[ri])}},
			Post:  []Local{{Kind: LReduce, Dst: work(across[ri]), Src: in(0, across[ri])}},
		})
		tag++
	}
	out := Region{bRecv, 0, work(sh.Rank).N}
	pl.add(step{Post: []Local{{Kind: LCopy, Dst: out, Src: work(sh.Rank)}, {Kind: LFinish, Dst: out}}})
	return pl
}

// planReduceShared plans an AllReduce or a ReduceScatter through the shared areas: no
// steps, only the reduction that execShared hands the shared areas.
func planReduceShared(op OpKind, k PlanKey) *Plan {
	dt, redop := k.Dt, k.Redop
	return &Plan{Op: op, Algo: Shared, Reduce: func(dst, src []byte) { dtype.Reduce(dt, redop, dst, src) }}
}
