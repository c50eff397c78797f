package algos

import (
	"encoding/binary"

	"fmt"
	"github.com/cespare/xxhash/v2"
	"io"
	"strings"

	"github.com/moex-ai/moex/coll/dtype"
)

// VLayout is the layout of a shared-area AlltoAllv that every rank knows in full (the MoE
// dispatch and combine plan from the whole count matrix), in bytes. Rank q's block for
// this rank is RecvLen[q] bytes at SrcOff[q] of q's send buffer, which is SrcLen[q] bytes
// long, and lands at RecvOff[q] of recv. This rank's own block is SrcOff[r] of send.
// SrcLen decides how each rank publishes its send buffer (through its area when it
// fits), so every rank must agree on it: the operation's signature should cover the
// counts.
type VLayout struct {
	RecvOff, RecvLen, SrcOff, SrcLen []int
}

// A plan is the schedule of one collective on one rank: steps, each a set of transfers
// posted together and local operations (copies, reductions) before and after them. Plans
// are pure: they are computed from (op, algorithm, ranks, rank, sizes, root) alone and
// never touch a transport, so they are tested without processes, cached, and printed by
// `moex flow`. The executor (exec.go) runs a plan on a transport.

type bufID uint8

const (
	bSend bufID = iota // the caller's input
	bRecv              // the caller's output (in-place ops work here)
	BTmp               // scratch owned by the executor
)

var bufNames = [...]string{"send", "recv", "tmp"}

type Region struct {
	Buf bufID
	Off int // bytes
	N   int // bytes
}

func (r Region) String() string { return fmt.Sprintf("%s[%d:+%d]", bufNames[r.Buf], r.Off, r.N) }

type Xfer struct {
	Peer int    // comm rank
	Tag  uint32 // tag within the op
	Region
}

type localKind uint8

const (
	LCopy   localKind = iota + 1 // dst = src
	LReduce                      // dst = dst op src
	LFinish                      // finish the reduction on dst (avg: divide by contributions)
)

type Local struct {
	Kind     localKind
	Dst, Src Region
}

type step struct {
	Pre          []Local
	Recvs, Sends []Xfer
	Mid          []Local // after posting the transfers, before waiting for them (overlap)
	Post         []Local
}

type Plan struct {
	Op    OpKind
	Algo  Algo
	Steps []step
	Tmp   int    // scratch bytes
	Sig   uint32 // checked on every message: ranks that disagree get ErrMismatch
	Bytes int    // bytes this rank sends, for statistics
	// Shared AlltoAllv and AllGather: where the blocks are in every rank's send buffer
	// and in recv (SharedAreas.AllToAllv); nil for the other plans.
	Shared *VLayout
	// Shared AllReduce and ReduceScatter: how to combine two buffers (the operation's
	// type and reduction), nil for the other plans.
	Reduce func(dst, src []byte)
}

func (p *Plan) add(s step) { p.Steps = append(p.Steps, s) }

// finishContrib is the number of contributions a finished reduction combined.
func (p *Plan) CountBytes() {
	p.Bytes = 0
	for _, s := range p.Steps {
		for _, x := range s.Sends {
			p.Bytes += x.N
		}
	}
}

// describe writes a readable form of the plan (moex flow, debugging).
func (p *Plan) Describe(w io.Writer, rank int) {
	fmt.Fprintf(w, "rank %d: %v/%v, %d steps, %d B scratch, %d B sent\n", rank, p.Op, p.Algo, len(p.Steps), p.Tmp, p.Bytes)
	for i, s := range p.Steps {
		var parts []string
		for _, l := range s.Pre {
			parts = append(parts, l.String())
		}
		for _, x := range s.Recvs {
			parts = append(parts, fmt.Sprintf("recv %s<-%d", x.Region, x.Peer))
		}
		for _, x := range s.Sends {
			parts = append(parts, fmt.Sprintf("send %s->%d", x.Region, x.Peer))
		}
		for _, l := range s.Mid {
			parts = append(parts, l.String()+" (while waiting)")
		}
		for _, l := range s.Post {
			parts = append(parts, l.String())
		}
		fmt.Fprintf(w, "  step %d: %s\n", i, strings.Join(parts, "; "))
	}
}

func (l Local) String() string {
	switch l.Kind {
	case LCopy:
		return fmt.Sprintf("copy %s<-%s", l.Dst, l.Src)
	case LReduce:
		return fmt.Sprintf("reduce %s+=%s", l.Dst, l.Src)
	}
	return fmt.Sprintf("finish %s", l.Dst)
}

// shape is everything a planner needs.
type Shape struct {
	P, Rank int
	Root    int
	Es      int // element size
	Count   int // elements (meaning per op: see each planner)
	// v is the block layout of the variable-size forms (AllGatherv, ReduceScatterv,
	// Gatherv, Scatterv); nil: count elements per rank, blocks packed in rank order.
	V *Blocks
}

// blocks is where each rank's block is, in bytes: in recv for AllGatherv and Gatherv, in
// send for Scatterv and ReduceScatterv (where they are always packed).
type Blocks struct {
	Off, N []int
	Packed bool // the blocks follow one another in rank order from offset 0
}

// blk is rank q's block in buffer b.
func (sh Shape) blk(b bufID, q int) Region {
	if sh.V == nil {
		n := sh.Count * sh.Es
		return Region{b, q * n, n}
	}
	return Region{b, sh.V.Off[q], sh.V.N[q]}
}

// span is blocks [lo, hi) of buffer b, which must be packed.
func (sh Shape) span(b bufID, lo, hi int) Region {
	if sh.V == nil {
		n := sh.Count * sh.Es
		return Region{b, lo * n, (hi - lo) * n}
	}
	if lo == hi {
		return Region{b, 0, 0}
	}
	end := sh.V.Off[hi-1] + sh.V.N[hi-1]
	return Region{b, sh.V.Off[lo], end - sh.V.Off[lo]}
}

// packed reports whether ranges of blocks are contiguous.
func (sh Shape) packed() bool { return sh.V == nil || sh.V.Packed }

// total is the bytes of every block; biggest the largest block.
func (sh Shape) total() int {
	if sh.V == nil {
		return sh.P * sh.Count * sh.Es
	}
	t := 0
	for _, n := range sh.V.N {
		t += n
	}
	return t
}

func (sh Shape) biggest() int {
	if sh.V == nil {
		return sh.Count * sh.Es
	}
	m := 0
	for _, n := range sh.V.N {
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

func CeilLog2(n int) int {
	k := 0
	for 1<<k < n {
		k++
	}
	return k
}

// signature hashes what every rank must agree on for an op (FNV-1a, no allocation).
func Signature(op OpKind, algo Algo, es int, fields ...int) uint32 {
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

type StringsBuilder = strings.Builder

// planKey identifies a cached plan.
type PlanKey struct {
	Op    OpKind
	Algo  Algo
	Dt    dtype.Type
	Redop dtype.Op
	Es    int
	Count int
	Root  int
}

// Hash identifies the layout (the cache of variable-size plans).
func (bl *Blocks) Hash() uint64 {
	var b [16]byte
	h := uint64(0)
	for q := range bl.Off {
		binary.LittleEndian.PutUint64(b[0:], uint64(bl.Off[q]))
		binary.LittleEndian.PutUint64(b[8:], uint64(bl.N[q]))
		h = h*0x9e3779b97f4a7c15 ^ xxhash.Sum64(b[:])
	}
	return h
}

// Clone copies bl.
func (bl *Blocks) Clone() *Blocks {
	return &Blocks{Off: append([]int(nil), bl.Off...), N: append([]int(nil), bl.N...), Packed: bl.Packed}
}

// Equal reports whether bl and o are the same layout.
func (bl *Blocks) Equal(o *Blocks) bool {
	if len(bl.Off) != len(o.Off) {
		return false
	}
	for q := range bl.Off {
		if bl.Off[q] != o.Off[q] || bl.N[q] != o.N[q] {
			return false
		}
	}
	return true
}
