package coll

import (
	"fmt"
	"io"
	"strings"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/transport"
)

// A plan is the schedule of one collective on one rank: steps, each a set of transfers
// posted together and local operations (copies, reductions) before and after them. Plans
// are pure: they are computed from (op, algorithm, ranks, rank, sizes, root) alone and
// never touch a transport, so they are tested without processes, cached, and printed by
// `moex flow`. The executor (exec.go) runs a plan on a transport.

type bufID uint8

const (
	bSend bufID = iota // the caller's input
	bRecv              // the caller's output (in-place ops work here)
	bTmp               // scratch owned by the executor
)

var bufNames = [...]string{"send", "recv", "tmp"}

type region struct {
	buf bufID
	off int // bytes
	n   int // bytes
}

func (r region) String() string { return fmt.Sprintf("%s[%d:+%d]", bufNames[r.buf], r.off, r.n) }

type xfer struct {
	peer int    // comm rank
	tag  uint32 // tag within the op
	region
}

type localKind uint8

const (
	lCopy   localKind = iota + 1 // dst = src
	lReduce                      // dst = dst op src
	lFinish                      // finish the reduction on dst (avg: divide by contributions)
)

type local struct {
	kind     localKind
	dst, src region
}

type step struct {
	pre          []local
	recvs, sends []xfer
	mid          []local // after posting the transfers, before waiting for them (overlap)
	post         []local
}

type plan struct {
	op    OpKind
	algo  Algo
	steps []step
	tmp   int    // scratch bytes
	sig   uint32 // checked on every message: ranks that disagree get ErrMismatch
	bytes int    // bytes this rank sends, for statistics
	// Shared AlltoAllv and AllGather: where the blocks are in every rank's send buffer
	// and in recv (SharedAreas.AllToAllv); nil for the other plans.
	shared *transport.VLayout
	// Shared AllReduce and ReduceScatter: how to combine two buffers (the operation's
	// type and reduction), nil for the other plans.
	reduce func(dst, src []byte)
}

func (p *plan) add(s step) { p.steps = append(p.steps, s) }

// finishContrib is the number of contributions a finished reduction combined.
func (p *plan) countBytes() {
	p.bytes = 0
	for _, s := range p.steps {
		for _, x := range s.sends {
			p.bytes += x.n
		}
	}
}

// describe writes a readable form of the plan (moex flow, debugging).
func (p *plan) describe(w io.Writer, rank int) {
	fmt.Fprintf(w, "rank %d: %v/%v, %d steps, %d B scratch, %d B sent\n", rank, p.op, p.algo, len(p.steps), p.tmp, p.bytes)
	for i, s := range p.steps {
		var parts []string
		for _, l := range s.pre {
			parts = append(parts, l.String())
		}
		for _, x := range s.recvs {
			parts = append(parts, fmt.Sprintf("recv %s<-%d", x.region, x.peer))
		}
		for _, x := range s.sends {
			parts = append(parts, fmt.Sprintf("send %s->%d", x.region, x.peer))
		}
		for _, l := range s.mid {
			parts = append(parts, l.String()+" (while waiting)")
		}
		for _, l := range s.post {
			parts = append(parts, l.String())
		}
		fmt.Fprintf(w, "  step %d: %s\n", i, strings.Join(parts, "; "))
	}
}

func (l local) String() string {
	switch l.kind {
	case lCopy:
		return fmt.Sprintf("copy %s<-%s", l.dst, l.src)
	case lReduce:
		return fmt.Sprintf("reduce %s+=%s", l.dst, l.src)
	}
	return fmt.Sprintf("finish %s", l.dst)
}

// shape is everything a planner needs.
type shape struct {
	p, rank int
	root    int
	es      int // element size
	count   int // elements (meaning per op: see each planner)
	// v is the block layout of the variable-size forms (AllGatherv, ReduceScatterv,
	// Gatherv, Scatterv); nil: count elements per rank, blocks packed in rank order.
	v *blocks
}

// blocks is where each rank's block is, in bytes: in recv for AllGatherv and Gatherv, in
// send for Scatterv and ReduceScatterv (where they are always packed).
type blocks struct {
	off, n []int
	packed bool // the blocks follow one another in rank order from offset 0
}

// blk is rank q's block in buffer b.
func (sh shape) blk(b bufID, q int) region {
	if sh.v == nil {
		n := sh.count * sh.es
		return region{b, q * n, n}
	}
	return region{b, sh.v.off[q], sh.v.n[q]}
}

// span is blocks [lo, hi) of buffer b, which must be packed.
func (sh shape) span(b bufID, lo, hi int) region {
	if sh.v == nil {
		n := sh.count * sh.es
		return region{b, lo * n, (hi - lo) * n}
	}
	if lo == hi {
		return region{b, 0, 0}
	}
	end := sh.v.off[hi-1] + sh.v.n[hi-1]
	return region{b, sh.v.off[lo], end - sh.v.off[lo]}
}

// packed reports whether ranges of blocks are contiguous.
func (sh shape) packed() bool { return sh.v == nil || sh.v.packed }

// total is the bytes of every block; biggest the largest block.
func (sh shape) total() int {
	if sh.v == nil {
		return sh.p * sh.count * sh.es
	}
	t := 0
	for _, n := range sh.v.n {
		t += n
	}
	return t
}

func (sh shape) biggest() int {
	if sh.v == nil {
		return sh.count * sh.es
	}
	m := 0
	for _, n := range sh.v.n {
		m = max(m, n)
	}
	return m
}

// split divides n elements into parts as even as possible: part i has n/parts elements,
// plus one for the first n%parts parts. It returns byte offsets and lengths.
func split(n, parts, es int) (off, ln []int) {
	off = make([]int, parts)
	ln = make([]int, parts)
	q, r := n/parts, n%parts
	o := 0
	for i := 0; i < parts; i++ {
		c := q
		if i < r {
			c++
		}
		off[i], ln[i] = o*es, c*es
		o += c
	}
	return off, ln
}

func mod(a, m int) int { return ((a % m) + m) % m }

func isPow2(n int) bool { return n > 0 && n&(n-1) == 0 }

func floorPow2(n int) int {
	p := 1
	for p*2 <= n {
		p *= 2
	}
	return p
}

func ceilLog2(n int) int {
	k := 0
	for 1<<k < n {
		k++
	}
	return k
}

// signature hashes what every rank must agree on for an op (FNV-1a, no allocation).
func signature(op OpKind, algo Algo, es int, fields ...int) uint32 {
	h := uint32(2166136261)
	mix := func(v int) {
		for i := 0; i < 8; i++ {
			h ^= uint32(byte(v >> (8 * i)))
			h *= 16777619
		}
	}
	mix(int(op))
	mix(int(algo))
	mix(es)
	for _, f := range fields {
		mix(f)
	}
	return h
}

type stringsBuilder = strings.Builder

// planKey identifies a cached plan.
type planKey struct {
	op    OpKind
	algo  Algo
	dt    dtype.Type
	redop dtype.Op
	es    int
	count int
	root  int
}

// vkey identifies a cached variable-size plan: the operation, and a hash of its blocks.
type vkey struct {
	planKey
	h uint64
}

type vcached struct {
	pl *plan
	bl *blocks
}
