package coll

// Planners, one per (op, algorithm). Each returns the schedule for rank sh.rank of sh.p.
// Conventions: the executor has already placed this rank's input where the plan expects
// it (AllReduce, Broadcast, Reduce: in recv; AllGather: this rank's block of recv); every
// transfer is posted even when empty, so that every pair of ranks that talks in an op
// checks the op's signature; tags are step numbers.

import (
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/transport"
)

// ---- AllReduce ----

func planAllReduceRing(sh shape) *plan {
	pl := &plan{op: OpAllReduce, algo: Ring}
	if sh.p == 1 {
		pl.add(step{post: []local{{kind: lFinish, dst: region{bRecv, 0, sh.count * sh.es}}}})
		return pl
	}
	all := make([]int, sh.p)
	for i := range all {
		all[i] = i
	}
	tag := uint32(0)
	off, cnt := ringReduceScatter(pl, all, sh.rank, 0, sh.count, sh.es, true, &tag)
	ringAllGather(pl, all, sh.rank, off, cnt, sh.es, &tag)
	return pl
}

// ringReduceScatter appends a ring reduce-scatter among members (comm ranks; this rank
// is members[me]) of the elements [first, first+count) of recv, cut into len(members)
// chunks: after it, members[i] holds chunk (i+1) mod len(members) reduced over all of
// them (finished when finish is set). It returns the chunks' element offsets (in recv)
// and counts.
func ringReduceScatter(pl *plan, members []int, me, first, count, es int, finish bool, tag *uint32) (off, cnt []int) {
	m := len(members)
	if m == 1 {
		if finish {
			pl.add(step{post: []local{{kind: lFinish, dst: region{bRecv, first * es, count * es}}}})
		}
		return []int{first}, []int{count}
	}
	boff, blen := split(count, m, es)
	off, cnt = make([]int, m), make([]int, m)
	for i := range boff {
		off[i], cnt[i] = first+boff[i]/es, blen[i]/es
		pl.tmp = max(pl.tmp, blen[i])
	}
	reg := func(i int) region { return region{bRecv, off[i] * es, cnt[i] * es} }
	next, prev := members[mod(me+1, m)], members[mod(me-1, m)]
	for k := 0; k < m-1; k++ {
		si, ri := mod(me-k, m), mod(me-k-1, m)
		tmp := region{bTmp, 0, cnt[ri] * es}
		s := step{
			sends: []xfer{{next, *tag, reg(si)}},
			recvs: []xfer{{prev, *tag, tmp}},
			post:  []local{{kind: lReduce, dst: reg(ri), src: tmp}},
		}
		if finish && k == m-2 {
			s.post = append(s.post, local{kind: lFinish, dst: reg(ri)})
		}
		pl.add(s)
		*tag++
	}
	return off, cnt
}

// ringAllGather appends the ring all-gather that follows ringReduceScatter: members[i]
// starts with chunk (i+1) mod len(members), every member ends with all of them.
func ringAllGather(pl *plan, members []int, me int, off, cnt []int, es int, tag *uint32) {
	m := len(members)
	reg := func(i int) region { return region{bRecv, off[i] * es, cnt[i] * es} }
	next, prev := members[mod(me+1, m)], members[mod(me-1, m)]
	for k := 0; k < m-1; k++ {
		si, ri := mod(me+1-k, m), mod(me-k, m)
		pl.add(step{
			sends: []xfer{{next, *tag, reg(si)}},
			recvs: []xfer{{prev, *tag, reg(ri)}},
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
func planAllReduceHier(sh shape, t topology) *plan {
	if pl := flatUnlessUniform(t, sh, planAllReduceRing); pl != nil {
		return pl
	}
	pl := &plan{op: OpAllReduce, algo: Hier}
	host, li := t.hostOf[sh.rank], t.local[sh.rank]
	home := t.members[host]
	across := make([]int, len(t.members))
	for h, ms := range t.members {
		across[h] = ms[li]
	}
	m := len(home)
	tag := uint32(0)
	first, count := 0, sh.count
	var off, cnt []int
	if m > 1 {
		off, cnt = ringReduceScatter(pl, home, li, 0, sh.count, sh.es, false, &tag)
		c := mod(li+1, m)
		first, count = off[c], cnt[c]
	}
	xoff, xcnt := ringReduceScatter(pl, across, host, first, count, sh.es, true, &tag)
	ringAllGather(pl, across, host, xoff, xcnt, sh.es, &tag)
	if m > 1 {
		ringAllGather(pl, home, li, off, cnt, sh.es, &tag)
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

func planAllReduceRecDbl(sh shape, algo Algo) *plan {
	p, r := sh.p, sh.rank
	n := sh.count * sh.es
	pl := &plan{op: OpAllReduce, algo: algo, tmp: n}
	all := region{bRecv, 0, n}
	tmpAll := region{bTmp, 0, n}
	pof2, rem, nr, real := foldPow2(p, r)
	tag := uint32(0)
	if rem > 0 {
		switch {
		case r < 2*rem && r%2 == 0:
			pl.add(step{sends: []xfer{{r + 1, tag, all}}})
		case r < 2*rem:
			pl.add(step{recvs: []xfer{{r - 1, tag, tmpAll}}, post: []local{{kind: lReduce, dst: all, src: tmpAll}}})
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
					sends: []xfer{{peer, tag, all}},
					recvs: []xfer{{peer, tag, tmpAll}},
					post:  []local{{kind: lReduce, dst: all, src: tmpAll}},
				})
				tag++
			}
			pl.add(step{post: []local{{kind: lFinish, dst: all}}})
		}
	}
	if rem > 0 {
		switch {
		case r < 2*rem && r%2 == 0:
			pl.add(step{recvs: []xfer{{r + 1, 1000, all}}})
		case r < 2*rem:
			pl.add(step{sends: []xfer{{r - 1, 1000, all}}})
		}
	}
	return pl
}

// rabenseifnerCore: reduce-scatter by recursive halving, then all-gather by recursive
// doubling, among pof2 active ranks; active rank nr ends the first phase owning chunk nr.
func rabenseifnerCore(pl *plan, sh shape, nr, pof2 int, real func(int) int, tag *uint32) {
	off, ln := split(sh.count, pof2, sh.es)
	span := func(lo, hi int) region {
		if lo >= hi {
			return region{bRecv, 0, 0}
		}
		return region{bRecv, off[lo], off[hi-1] + ln[hi-1] - off[lo]}
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
			sends: []xfer{{peer, *tag, span(give.lo, give.hi)}},
			recvs: []xfer{{peer, *tag, region{bTmp, 0, k.n}}},
			post:  []local{{kind: lReduce, dst: k, src: region{bTmp, 0, k.n}}},
		})
		*tag++
		wins = append(wins, win{lo, hi})
		lo, hi = keep.lo, keep.hi
	}
	pl.add(step{post: []local{{kind: lFinish, dst: span(lo, hi)}}})
	for mask := 1; mask < pof2; mask <<= 1 {
		peer := real(nr ^ mask)
		outer := wins[len(wins)-1]
		wins = wins[:len(wins)-1]
		mine := span(lo, hi)
		var theirs region
		if lo == outer.lo {
			theirs = span(hi, outer.hi)
		} else {
			theirs = span(outer.lo, lo)
		}
		pl.add(step{
			sends: []xfer{{peer, *tag, mine}},
			recvs: []xfer{{peer, *tag, theirs}},
		})
		*tag++
		lo, hi = outer.lo, outer.hi
	}
}

// ---- Broadcast, Reduce ----

func planBroadcastBinomial(sh shape) *plan {
	p, r := sh.p, sh.rank
	all := region{bRecv, 0, sh.count * sh.es}
	pl := &plan{op: OpBroadcast, algo: Binomial}
	vr := mod(r-sh.root, p)
	real := func(v int) int { return mod(v+sh.root, p) }
	tag := uint32(0)
	for mask := 1; mask < p; mask <<= 1 {
		var s step
		switch {
		case vr < mask && vr+mask < p:
			s.sends = []xfer{{real(vr + mask), tag, all}}
		case vr >= mask && vr < 2*mask:
			s.recvs = []xfer{{real(vr - mask), tag, all}}
		}
		pl.add(s)
		tag++
	}
	return pl
}

func planBroadcastLinear(sh shape) *plan {
	all := region{bRecv, 0, sh.count * sh.es}
	pl := &plan{op: OpBroadcast, algo: Linear}
	var s step
	if sh.rank == sh.root {
		for q := 0; q < sh.p; q++ {
			if q != sh.root {
				s.sends = append(s.sends, xfer{q, 0, all})
			}
		}
	} else {
		s.recvs = []xfer{{sh.root, 0, all}}
	}
	pl.add(s)
	return pl
}

func planReduceBinomial(sh shape) *plan {
	p, r := sh.p, sh.rank
	n := sh.count * sh.es
	all := region{bRecv, 0, n}
	tmp := region{bTmp, 0, n}
	pl := &plan{op: OpReduce, algo: Binomial, tmp: n}
	vr := mod(r-sh.root, p)
	real := func(v int) int { return mod(v+sh.root, p) }
	tag := uint32(0)
	for mask := 1; mask < p; mask <<= 1 {
		var s step
		switch {
		case vr&(2*mask-1) == mask:
			s.sends = []xfer{{real(vr - mask), tag, all}}
		case vr&(2*mask-1) == 0 && vr+mask < p:
			s.recvs = []xfer{{real(vr + mask), tag, tmp}}
			s.post = []local{{kind: lReduce, dst: all, src: tmp}}
		}
		pl.add(s)
		tag++
	}
	if r == sh.root {
		pl.add(step{post: []local{{kind: lFinish, dst: all}}})
	}
	return pl
}

func planReduceLinear(sh shape) *plan {
	n := sh.count * sh.es
	all := region{bRecv, 0, n}
	pl := &plan{op: OpReduce, algo: Linear}
	if sh.rank != sh.root {
		pl.add(step{sends: []xfer{{sh.root, 0, all}}})
		return pl
	}
	// The root receives every contribution, then reduces in rank order.
	pl.tmp = n * (sh.p - 1)
	var s step
	j := 0
	for q := 0; q < sh.p; q++ {
		if q == sh.root {
			continue
		}
		t := region{bTmp, j * n, n}
		s.recvs = append(s.recvs, xfer{q, 0, t})
		s.post = append(s.post, local{kind: lReduce, dst: all, src: t})
		j++
	}
	s.post = append(s.post, local{kind: lFinish, dst: all})
	pl.add(s)
	return pl
}

// ---- AllGather (count = elements per rank) ----

// planAllGatherShared: every rank publishes its block (in place in recv) in its shared
// area, or for the others to read across, and takes everyone else's (transport.SharedAreas).
func planAllGatherShared(sh shape) *plan {
	p := sh.p
	v := &transport.VLayout{RecvOff: make([]int, p), RecvLen: make([]int, p), SrcOff: make([]int, p), SrcLen: make([]int, p)}
	for q := 0; q < p; q++ {
		r := sh.blk(bRecv, q)
		v.RecvOff[q], v.RecvLen[q], v.SrcLen[q] = r.off, r.n, r.n
	}
	return &plan{op: OpAllGather, algo: Shared, shared: v}
}

func planAllGatherRing(sh shape) *plan {
	p, r := sh.p, sh.rank
	pl := &plan{op: OpAllGather, algo: Ring}
	next, prev := mod(r+1, p), mod(r-1, p)
	for k := 0; k < p-1; k++ {
		pl.add(step{
			sends: []xfer{{next, uint32(k), sh.blk(bRecv, mod(r-k, p))}},
			recvs: []xfer{{prev, uint32(k), sh.blk(bRecv, mod(r-k-1, p))}},
		})
	}
	return pl
}

// planAllGatherRecDbl exchanges ranges of blocks that double each step; with a
// non-power-of-two of ranks, or blocks not packed in rank order, it runs Bruck's.
func planAllGatherRecDbl(sh shape) *plan {
	p, r := sh.p, sh.rank
	if !isPow2(p) || !sh.packed() {
		pl := planAllGatherBruck(sh)
		pl.algo = RecDoubling
		return pl
	}
	pl := &plan{op: OpAllGather, algo: RecDoubling}
	tag := uint32(0)
	for mask := 1; mask < p; mask <<= 1 {
		peer := r ^ mask
		mine, theirs := r&^(mask-1), peer&^(mask-1)
		pl.add(step{
			sends: []xfer{{peer, tag, sh.span(bRecv, mine, mine+mask)}},
			recvs: []xfer{{peer, tag, sh.span(bRecv, theirs, theirs+mask)}},
		})
		tag++
	}
	return pl
}

// planAllGatherBruck works for any size in ceil(log2 p) steps: blocks accumulate in a
// rotated scratch layout (position i holds rank r+i's block), rotated back at the end.
func planAllGatherBruck(sh shape) *plan {
	p, r := sh.p, sh.rank
	// at[i] is where position i starts in the scratch; at[p] its size.
	at := make([]int, p+1)
	for i := 0; i < p; i++ {
		at[i+1] = at[i] + sh.blk(bRecv, mod(r+i, p)).n
	}
	pl := &plan{op: OpAllGather, algo: Bruck, tmp: at[p]}
	t := func(i, k int) region { return region{bTmp, at[i], at[i+k] - at[i]} }
	pl.add(step{pre: []local{{kind: lCopy, dst: t(0, 1), src: sh.blk(bRecv, r)}}})
	tag := uint32(0)
	for have := 1; have < p; have *= 2 {
		k := min(have, p-have)
		pl.add(step{
			sends: []xfer{{mod(r-have, p), tag, t(0, k)}},
			recvs: []xfer{{mod(r+have, p), tag, t(have, k)}},
		})
		tag++
	}
	var last step
	for i := 0; i < p; i++ {
		last.post = append(last.post, local{kind: lCopy, dst: sh.blk(bRecv, mod(r+i, p)), src: t(i, 1)})
	}
	pl.add(last)
	return pl
}

// ---- ReduceScatter (count = elements per rank; input: every rank's block in send) ----

func planReduceScatterRing(sh shape) *plan {
	p, r := sh.p, sh.rank
	total := sh.total()
	work := func(i int) region { return sh.blk(bTmp, i) }
	pl := &plan{op: OpReduceScatter, algo: Ring, tmp: total + sh.biggest()}
	pl.add(step{pre: []local{{kind: lCopy, dst: region{bTmp, 0, total}, src: region{bSend, 0, total}}}})
	next, prev := mod(r+1, p), mod(r-1, p)
	for k := 0; k < p-1; k++ {
		si, ri := mod(r-k-1, p), mod(r-k-2, p)
		in := region{bTmp, total, work(ri).n}
		pl.add(step{
			sends: []xfer{{next, uint32(k), work(si)}},
			recvs: []xfer{{prev, uint32(k), in}},
			post:  []local{{kind: lReduce, dst: work(ri), src: in}},
		})
	}
	out := region{bRecv, 0, work(r).n}
	pl.add(step{post: []local{{kind: lCopy, dst: out, src: work(r)}, {kind: lFinish, dst: out}}})
	return pl
}

func planReduceScatterRecHalving(sh shape) *plan {
	p, r := sh.p, sh.rank
	if !isPow2(p) {
		pl := planReduceScatterRing(sh)
		pl.algo = RecHalving
		return pl
	}
	total := sh.total()
	pl := &plan{op: OpReduceScatter, algo: RecHalving, tmp: 2 * total}
	work := func(lo, hi int) region { return sh.span(bTmp, lo, hi) }
	pl.add(step{pre: []local{{kind: lCopy, dst: work(0, p), src: region{bSend, 0, total}}}})
	lo, hi := 0, p
	tag := uint32(0)
	for mask := p / 2; mask >= 1; mask >>= 1 {
		peer := r ^ mask
		mid := (lo + hi) / 2
		klo, khi, glo, ghi := lo, mid, mid, hi
		if r&mask != 0 {
			klo, khi, glo, ghi = mid, hi, lo, mid
		}
		in := region{bTmp, total, work(klo, khi).n}
		pl.add(step{
			sends: []xfer{{peer, tag, work(glo, ghi)}},
			recvs: []xfer{{peer, tag, in}},
			post:  []local{{kind: lReduce, dst: work(klo, khi), src: in}},
		})
		tag++
		lo, hi = klo, khi
	}
	out := region{bRecv, 0, work(r, r+1).n}
	pl.add(step{post: []local{{kind: lCopy, dst: out, src: work(r, r+1)}, {kind: lFinish, dst: out}}})
	return pl
}

// ---- AlltoAll(v) ----

// vlayout is an AlltoAllv layout in bytes: what this rank sends to and receives from
// each peer.
type vlayout struct {
	sendOff, sendLen []int
	recvOff, recvLen []int
}

func evenLayout(p, b int) vlayout {
	l := vlayout{make([]int, p), make([]int, p), make([]int, p), make([]int, p)}
	for i := 0; i < p; i++ {
		l.sendOff[i], l.sendLen[i], l.recvOff[i], l.recvLen[i] = i*b, b, i*b, b
	}
	return l
}

// stepAt returns step i of pl, emptied, reusing the storage of an earlier plan built into
// pl (AlltoAllv plans are rebuilt per call without allocating).
func (pl *plan) stepAt(i int) *step {
	if i >= len(pl.steps) {
		if i < cap(pl.steps) {
			pl.steps = pl.steps[:i+1]
		} else {
			pl.steps = append(pl.steps, step{})
		}
	}
	s := &pl.steps[i]
	s.pre, s.recvs, s.sends, s.mid, s.post = s.pre[:0], s.recvs[:0], s.sends[:0], s.mid[:0], s.post[:0]
	return s
}

func planAlltoAllLinear(pl *plan, p, r int, l vlayout) {
	pl.steps = pl.steps[:0]
	s := pl.stepAt(0)
	// Our own block is copied while the transfers are under way.
	s.mid = append(s.mid, local{kind: lCopy, dst: region{bRecv, l.recvOff[r], l.recvLen[r]}, src: region{bSend, l.sendOff[r], l.sendLen[r]}})
	for k := 1; k < p; k++ {
		from, to := mod(r-k, p), mod(r+k, p)
		s.recvs = append(s.recvs, xfer{from, 0, region{bRecv, l.recvOff[from], l.recvLen[from]}})
		s.sends = append(s.sends, xfer{to, 0, region{bSend, l.sendOff[to], l.sendLen[to]}})
	}
}

func planAlltoAllPairwise(pl *plan, p, r int, l vlayout) {
	pl.steps = pl.steps[:0]
	for k := 1; k < p; k++ {
		from, to := mod(r-k, p), mod(r+k, p)
		s := pl.stepAt(k - 1)
		if k == 1 { // our own block, while the first exchange is under way
			s.mid = append(s.mid, local{kind: lCopy, dst: region{bRecv, l.recvOff[r], l.recvLen[r]}, src: region{bSend, l.sendOff[r], l.sendLen[r]}})
		}
		s.recvs = append(s.recvs, xfer{from, uint32(k), region{bRecv, l.recvOff[from], l.recvLen[from]}})
		s.sends = append(s.sends, xfer{to, uint32(k), region{bSend, l.sendOff[to], l.sendLen[to]}})
	}
	if p == 1 {
		s := pl.stepAt(0)
		s.pre = append(s.pre, local{kind: lCopy, dst: region{bRecv, l.recvOff[r], l.recvLen[r]}, src: region{bSend, l.sendOff[r], l.sendLen[r]}})
	}
}

// planAlltoAllBruck: log2(p) steps of larger messages, for small blocks. Block sizes are
// given by the full count matrix c[src][dst] in bytes (every rank knows it). Scratch holds
// p slots of the largest block (the rotated working layout) and two packing areas.
func planAlltoAllBruck(pl *plan, p, r int, l vlayout, c [][]int) {
	maxb := 0
	for _, row := range c {
		for _, v := range row {
			maxb = max(maxb, v)
		}
	}
	half := (p + 1) / 2
	slot := func(i, n int) region { return region{bTmp, i * maxb, n} }
	packOff, unpackOff := p*maxb, p*maxb+half*maxb
	pl.tmp = p*maxb + 2*half*maxb
	// Phase 1: slot i holds the block for rank r+i.
	var first step
	for i := 0; i < p; i++ {
		d := mod(r+i, p)
		first.pre = append(first.pre, local{kind: lCopy, dst: slot(i, l.sendLen[d]), src: region{bSend, l.sendOff[d], l.sendLen[d]}})
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
			s.pre = append(s.pre, local{kind: lCopy, dst: region{bTmp, po, n}, src: slot(i, n)})
			po += n
			m := size(from, i, pof)
			s.post = append(s.post, local{kind: lCopy, dst: slot(i, m), src: region{bTmp, uo, m}})
			uo += m
		}
		s.sends = []xfer{{to, tag, region{bTmp, packOff, po - packOff}}}
		s.recvs = []xfer{{from, tag, region{bTmp, unpackOff, uo - unpackOff}}}
		pl.add(s)
		tag++
	}
	// Phase 3: what came from rank j sits in slot r-j.
	var last step
	for j := 0; j < p; j++ {
		last.post = append(last.post, local{kind: lCopy, dst: region{bRecv, l.recvOff[j], l.recvLen[j]}, src: slot(mod(r-j, p), l.recvLen[j])})
	}
	pl.add(last)
}

// ---- Scatter, Gather (count = elements per rank), Barrier ----

func planScatterLinear(sh shape) *plan {
	pl := &plan{op: OpScatter, algo: Linear}
	var s step
	if sh.rank == sh.root {
		mine := sh.blk(bSend, sh.root)
		s.pre = []local{{kind: lCopy, dst: region{bRecv, 0, mine.n}, src: mine}}
		for q := 0; q < sh.p; q++ {
			if q != sh.root {
				s.sends = append(s.sends, xfer{q, 0, sh.blk(bSend, q)})
			}
		}
	} else {
		s.recvs = []xfer{{sh.root, 0, region{bRecv, 0, sh.blk(bRecv, sh.rank).n}}}
	}
	pl.add(s)
	return pl
}

func planGatherLinear(sh shape) *plan {
	pl := &plan{op: OpGather, algo: Linear}
	var s step
	if sh.rank == sh.root {
		mine := sh.blk(bRecv, sh.root)
		s.pre = []local{{kind: lCopy, dst: mine, src: region{bSend, 0, mine.n}}}
		for q := 0; q < sh.p; q++ {
			if q != sh.root {
				s.recvs = append(s.recvs, xfer{q, 0, sh.blk(bRecv, q)})
			}
		}
	} else {
		s.sends = []xfer{{sh.root, 0, region{bSend, 0, sh.blk(bSend, sh.rank).n}}}
	}
	pl.add(s)
	return pl
}

func planBarrier(sh shape) *plan {
	pl := &plan{op: OpBarrier, algo: Dissemination}
	for k, d := 0, 1; d < sh.p; k, d = k+1, d*2 {
		pl.add(step{
			sends: []xfer{{mod(sh.rank+d, sh.p), uint32(k), region{bRecv, 0, 0}}},
			recvs: []xfer{{mod(sh.rank-d, sh.p), uint32(k), region{bRecv, 0, 0}}},
		})
	}
	return pl
}

// ---- hierarchical AllGather and ReduceScatter ----

// flatUnlessUniform returns the flat plan, labelled hier, when hosts hold unequal numbers
// of ranks (or there is one host); nil when the hierarchical plan applies.
func flatUnlessUniform(t topology, sh shape, flat func(shape) *plan) *plan {
	if t.uniform {
		return nil
	}
	pl := flat(sh)
	pl.algo = Hier
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

func newHierView(t topology, rank int) hierView {
	v := hierView{host: t.hostOf[rank], li: t.local[rank], h: len(t.members), m: len(t.members[0])}
	v.groups = make([][]int, v.m)
	for j := range v.groups {
		v.groups[j] = make([]int, v.h)
		for h, ms := range t.members {
			v.groups[j][h] = ms[j]
		}
	}
	v.across, v.home = v.groups[v.li], t.members[v.host]
	return v
}

// planAllGatherHier: a ring all-gather among the ranks with this rank's local index (one
// on each host: every rank crosses hosts H-1 times, for one block each), then a ring
// all-gather within the host of what each gathered (a group of H blocks per step). A
// flat ring over ranks that alternate hosts crosses at every one of its P-1 steps. Hosts
// with unequal numbers of ranks get the flat ring.
func planAllGatherHier(sh shape, t topology) *plan {
	if pl := flatUnlessUniform(t, sh, planAllGatherRing); pl != nil {
		return pl
	}
	blk := func(q int) region { return sh.blk(bRecv, q) }
	pl := &plan{op: OpAllGather, algo: Hier}
	v := newHierView(t, sh.rank)
	host, li, groups, across, home, h, m := v.host, v.li, v.groups, v.across, v.home, v.h, v.m
	tag := uint32(0)
	next, prev := across[mod(host+1, h)], across[mod(host-1, h)]
	for k := 0; k < h-1; k++ {
		pl.add(step{
			sends: []xfer{{next, tag, blk(across[mod(host-k, h)])}},
			recvs: []xfer{{prev, tag, blk(across[mod(host-k-1, h)])}},
		})
		tag++
	}
	next, prev = home[mod(li+1, m)], home[mod(li-1, m)]
	for k := 0; k < m-1; k++ {
		var s step
		sg, rg := groups[mod(li-k, m)], groups[mod(li-k-1, m)]
		for i := 0; i < h; i++ {
			s.sends = append(s.sends, xfer{next, tag, blk(sg[i])})
			s.recvs = append(s.recvs, xfer{prev, tag, blk(rg[i])})
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
func planReduceScatterHier(sh shape, t topology) *plan {
	if pl := flatUnlessUniform(t, sh, planReduceScatterRing); pl != nil {
		return pl
	}
	total, big := sh.total(), sh.biggest()
	v := newHierView(t, sh.rank)
	host, li, groups, across, home, h, m := v.host, v.li, v.groups, v.across, v.home, v.h, v.m
	work := func(q int) region { return sh.blk(bTmp, q) }
	in := func(i, q int) region { return region{bTmp, total + i*big, work(q).n} } // slot i, for rank q's block
	pl := &plan{op: OpReduceScatter, algo: Hier, tmp: total + h*big}
	pl.add(step{pre: []local{{kind: lCopy, dst: region{bTmp, 0, total}, src: region{bSend, 0, total}}}})
	tag := uint32(0)
	next, prev := home[mod(li+1, m)], home[mod(li-1, m)]
	for k := 0; k < m-1; k++ {
		var s step
		sg, rg := groups[mod(li-k-1, m)], groups[mod(li-k-2, m)]
		for i := 0; i < h; i++ {
			s.sends = append(s.sends, xfer{next, tag, work(sg[i])})
			s.recvs = append(s.recvs, xfer{prev, tag, in(i, rg[i])})
			s.post = append(s.post, local{kind: lReduce, dst: work(rg[i]), src: in(i, rg[i])})
			tag++
		}
		pl.add(s)
	}
	next, prev = across[mod(host+1, h)], across[mod(host-1, h)]
	for k := 0; k < h-1; k++ {
		si, ri := mod(host-k-1, h), mod(host-k-2, h)
		pl.add(step{
			sends: []xfer{{next, tag, work(across[si])}},
			recvs: []xfer{{prev, tag, in(0, across[ri])}},
			post:  []local{{kind: lReduce, dst: work(across[ri]), src: in(0, across[ri])}},
		})
		tag++
	}
	out := region{bRecv, 0, work(sh.rank).n}
	pl.add(step{post: []local{{kind: lCopy, dst: out, src: work(sh.rank)}, {kind: lFinish, dst: out}}})
	return pl
}

// planReduceShared plans an AllReduce or a ReduceScatter through the shared areas: no
// steps, only the reduction that execShared hands the shared areas.
func planReduceShared(op OpKind, k planKey) *plan {
	dt, redop := k.dt, k.redop
	return &plan{op: op, algo: Shared, reduce: func(dst, src []byte) { dtype.Reduce(dt, redop, dst, src) }}
}
