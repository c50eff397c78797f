package dispatch

import (
	"slices"

	"github.com/moex-ai/moex/coll/dtype"
)

// The planning half of a step: pure functions of the configuration and the row counts,
// which touch no transport. They lay out a Schedule; the modes' executors iterate it and
// move the bytes it says, Plan makes one per rank for moex flow and tests, and Stats and
// the Plan's byte matrices sum it.

// Schedule is one rank's part of a step, as the planner lays it out and the executors
// move it: for every peer, the block this rank sends it and the block it receives from
// it, in the dispatch and in the combine, field by field.
type Schedule struct {
	Mode  Mode // the mode the step ran in (in the Auto mode, the one it chose)
	Rank  int  // this rank
	Ranks int  // the ranks of the step
	// Control is the bytes every rank contributes to the step's control all-gather
	// before the dispatch (the normal and gathered modes' counts; 0 in the low-latency
	// mode, whose counts travel with the rows).
	Control  int
	Dispatch Stage
	Combine  Stage
}

// clone is a copy of s that shares no memory with it.
func (s *Schedule) clone() Schedule {
	c := *s
	c.Dispatch, c.Combine = s.Dispatch.clone(), s.Combine.clone()
	return c
}

func (st Stage) clone() Stage {
	return Stage{Fields: slices.Clone(st.Fields), Send: slices.Clone(st.Send), Recv: slices.Clone(st.Recv)}
}

// Stage is one exchange of a step: a block to and from every peer.
type Stage struct {
	// Fields names the parts of a block, which travel apart (the low-latency mode's
	// exchange fields, the gathered mode's all-gathers) or as one (a block of an
	// AlltoAllv).
	Fields []string
	// Send[q] is what this rank sends rank q, Recv[q] what it receives from q. Send[Rank]
	// and Recv[Rank] are this rank's own rows: they move only where the mode sends a
	// rank its own block (the low-latency exchange).
	Send, Recv []Block
}

// Block is what moves between two ranks in one stage.
type Block struct {
	Rows    int    // rows: tokens (dispatch), partial sums or rows of terms (combine)
	Choices int    // the (token, expert) choices the rows carry
	Bytes   [3]int // bytes of each field
	// Off is where each field starts in this rank's buffer of that field (the
	// AlltoAllv's send or receive buffer, a gathered buffer); 0 where every block has
	// a buffer of its own (the low-latency exchange).
	Off [3]int
	// InPlace: the rows stay where their sender wrote them and the receiver reads them
	// there (the low-latency mode on one host); Bytes counts only what moves.
	InPlace bool
	// Read is the bytes the receiver reads in place in the sender's memory.
	Read int
}

// Total is the bytes of the block's fields.
func (b Block) Total() int { return b.Bytes[0] + b.Bytes[1] + b.Bytes[2] }

// Sent is the bytes this rank (me) puts on the wire for its peers in the stage, its own
// block aside.
func (st Stage) Sent(me int) int { return sumOff(st.Send, me) }

// Received is the bytes this rank (me) takes from its peers in the stage, its own block
// aside.
func (st Stage) Received(me int) int { return sumOff(st.Recv, me) }

func sumOff(bs []Block, me int) int {
	n := 0
	for q, b := range bs {
		if q != me {
			n += b.Total()
		}
	}
	return n
}

// counts is what a rank knows of a step's rows when it plans: rows and choices it sends
// each rank, and receives from each, and every rank's tokens (gathered mode).
type counts struct {
	rowsTo, choicesTo     []int
	rowsFrom, choicesFrom []int
	tokens                []int // per rank (gathered mode); tokens[me] in every mode
	// The low-latency mode: this rank staged its rows where the experts read them, and
	// each sender did (its block's header says so).
	sentInPlace bool
	fromInPlace []bool
}

// planner lays out one mode's stages from the counts: the pure half of a mode, which
// its executors iterate and NewPlan uses without them. Each mode has one (policy.plan); the
// mode is chosen once, where the planner is. The formats come by value: a pointer
// through the interface would escape, an allocation per step.
type planner interface {
	// control is the bytes every rank contributes to the step's control all-gather
	// before the dispatch, on p ranks.
	control(p int) int
	dispatch(st *Stage, f Format, me int, k *counts)
	// combine lays out the way back; inPlace: the origins read the expert outputs where
	// they were written.
	combine(st *Stage, f CombineFormat, me int, k *counts, inPlace bool)
}

// policy is what a mode decides without running anything: the protocol a step runs in,
// how many tokens a dispatch may carry, what is read in place, and the planner. The
// dispatcher's modes and NewPlan share it, so that a plan is the step the dispatcher
// runs.
type policy interface {
	// step is the configuration of the protocol that a step whose largest rank has most
	// tokens runs in: the flat modes' own; the Auto mode's pick.
	step(cfg Config, ccfg CombineConfig, out dtype.Type, most int, shared bool) (Config, CombineConfig)
	// capacity is the most tokens a dispatch of cfg may carry (0: any number).
	capacity(cfg Config) int
	// inPlace says whether the rows and the expert outputs are read where they were
	// written (outputs of type out), where every rank maps every rank's memory (shared)
	// or not.
	inPlace(cfg Config, ccfg CombineConfig, out dtype.Type, shared bool) (rows, outs bool)
	plan() planner
}

// policies are the modes' policies.
var policies = map[Mode]policy{Auto: autoPolicy{}, Normal: normalPlan{}, LowLatency: llPlan{}, Gathered: gatheredPlan{}}

// flatPolicy is the policy of a protocol that runs every step itself: its own
// configuration, any number of tokens, nothing read in place (normal, gathered; the
// low-latency protocol says otherwise of the last two).
type flatPolicy struct{}

func (flatPolicy) step(cfg Config, ccfg CombineConfig, _ dtype.Type, _ int, _ bool) (Config, CombineConfig) {
	return cfg, ccfg
}
func (flatPolicy) capacity(Config) int { return 0 }
func (flatPolicy) inPlace(Config, CombineConfig, dtype.Type, bool) (bool, bool) {
	return false, false
}

// The names of the stages' fields (allocated once: the schedules are laid out per step).
var (
	oneField               = []string{"block"}
	llDispatchFields       = []string{"header+meta", "payload", "scales"}
	llCombineFields        = []string{"header", "partials"}
	gatheredDispatchFields = []string{"meta", "payload", "scales"}
	gatheredCombineFields  = []string{"partials"}
)

// begin sizes st for p ranks and names its fields.
func begin(st *Stage, fields []string, p int) {
	st.Fields = fields
	st.Send, st.Recv = growBlocks(st.Send, p), growBlocks(st.Recv, p)
}

// The normal mode: one AlltoAllv block per peer, side by side in one buffer each way; a
// rank's own rows stay where they are.
type normalPlan struct{ flatPolicy }

func (normalPlan) plan() planner { return normalPlan{} }

func (normalPlan) control(p int) int { return 8 * (hdrLen + p) }

func (normalPlan) dispatch(st *Stage, f Format, me int, k *counts) {
	p := len(k.rowsTo)
	begin(st, oneField, p)
	block := func(n, m int) Block { return Block{Rows: n, Choices: m, Bytes: [3]int{normalBlockBytes(&f, n, m)}} }
	for q := 0; q < p; q++ {
		st.Send[q], st.Recv[q] = block(k.rowsTo[q], k.choicesTo[q]), block(k.rowsFrom[q], k.choicesFrom[q])
	}
	st.Send[me].Bytes, st.Recv[me].Bytes = [3]int{}, [3]int{}
	layOut(st.Send, me)
	layOut(st.Recv, me)
}

func (normalPlan) combine(st *Stage, f CombineFormat, me int, k *counts, inPlace bool) {
	p := len(k.rowsTo)
	begin(st, oneField, p)
	for q := 0; q < p; q++ {
		st.Send[q] = backBlock(&f, k.rowsFrom[q], k.choicesFrom[q], inPlace, true)
		st.Recv[q] = backBlock(&f, k.rowsTo[q], k.choicesTo[q], inPlace, true)
	}
	st.Send[me].Bytes, st.Recv[me].Bytes = [3]int{}, [3]int{} // a rank's own answers stay
	layOut(st.Send, me)
	layOut(st.Recv, me)
}

// normalBlockBytes is the bytes of a normal-mode dispatch block of n rows carrying m
// choices: a header, then each row (metadata, payload, scales) with its choices.
func normalBlockBytes(f *Format, n, m int) int { return blockHeader + n*f.RowBytes(0) + 8*m }

// The low-latency mode: a block of its own per peer, in three fields (header and
// metadata, payloads, scales); a rank sends itself its block too. In place, the payloads
// and scales are read where their sender staged them.
type llPlan struct{ flatPolicy }

func (llPlan) plan() planner { return llPlan{} }

// capacity is MaxTokens: the buffers hold that many tokens per rank.
func (llPlan) capacity(cfg Config) int { return cfg.MaxTokens }

// inPlace: where every rank maps every rank's memory, the rows are read in their
// origins' staging unless PushRows, and the outputs where the experts wrote them unless
// SendPartials, each where its buffers fit (stagingRows, boardSize).
func (llPlan) inPlace(cfg Config, ccfg CombineConfig, out dtype.Type, shared bool) (rows, outs bool) {
	p := cfg.Placement.Ranks
	if !shared || p == 1 {
		return false, false
	}
	return !cfg.PushRows && stagingRows(NewFormat(cfg), cfg.MaxTokens, p) > 0, boardSize(cfg, ccfg, p, out.Size()) > 0
}

func (llPlan) control(int) int { return 0 } // the counts travel with the rows

func (llPlan) dispatch(st *Stage, f Format, me int, k *counts) {
	p := len(k.rowsTo)
	begin(st, llDispatchFields, p)
	block := func(n, m int, inPlace bool) Block {
		b := Block{Rows: n, Choices: m, Bytes: [3]int{blockHeader + n*f.MetaBytes(0) + 8*m, n * f.Payload, n * f.ScaleBytes()}}
		if inPlace {
			b.Bytes[1], b.Bytes[2], b.InPlace, b.Read = 0, 0, true, n*(f.Payload+f.ScaleBytes())
		}
		return b
	}
	for q := 0; q < p; q++ {
		st.Send[q] = block(k.rowsTo[q], k.choicesTo[q], k.sentInPlace)
		st.Recv[q] = block(k.rowsFrom[q], k.choicesFrom[q], k.fromInPlace != nil && k.fromInPlace[q])
	}
}

func (llPlan) combine(st *Stage, f CombineFormat, me int, k *counts, inPlace bool) {
	p := len(k.rowsTo)
	begin(st, llCombineFields, p)
	for q := 0; q < p; q++ {
		st.Send[q] = backBlock(&f, k.rowsFrom[q], k.choicesFrom[q], inPlace, false)
		st.Recv[q] = backBlock(&f, k.rowsTo[q], k.choicesTo[q], inPlace, false)
	}
	// A rank's own answers stay in its memory; its header still goes to itself.
	st.Send[me].Bytes, st.Recv[me].Bytes = [3]int{blockHeader}, [3]int{blockHeader}
}

// backBlock is the block of the way back that answers n rows carrying m choices: a
// header and the partial sums (or terms), in one field (one) or two; in place, the
// header alone, the receiver reading the m outputs of TermRow bytes where they were
// written.
func backBlock(f *CombineFormat, n, m int, inPlace, one bool) Block {
	b := Block{Rows: n, Choices: m}
	switch {
	case inPlace:
		b.Bytes[0], b.InPlace, b.Read = blockHeader, true, m*f.TermRow
	case one:
		b.Bytes[0] = blockHeader + f.Block(n, m)
	default:
		b.Bytes = [3]int{blockHeader, f.Block(n, m)}
	}
	return b
}

// The gathered mode: every rank's tokens, with every choice, to every rank (one send
// buffer, every rank's side by side where they arrive); the way back a partial sum per
// token of the receiver, reduce-scattered.
type gatheredPlan struct{ flatPolicy }

func (gatheredPlan) plan() planner { return gatheredPlan{} }

func (gatheredPlan) control(p int) int { return 8 * (hdrLen + p) }

func (gatheredPlan) dispatch(st *Stage, f Format, me int, k *counts) {
	p := len(k.rowsTo)
	begin(st, gatheredDispatchFields, p)
	block := func(n int) Block {
		return Block{Rows: n, Bytes: [3]int{n * f.GatheredMeta(), n * f.Payload, n * f.ScaleBytes()}}
	}
	for q := 0; q < p; q++ {
		st.Send[q], st.Recv[q] = block(k.tokens[me]), block(k.tokens[q])
	}
	layOut(st.Recv, -1)
}

func (gatheredPlan) combine(st *Stage, f CombineFormat, me int, k *counts, _ bool) {
	p := len(k.rowsTo)
	begin(st, gatheredCombineFields, p)
	for q := 0; q < p; q++ {
		st.Send[q] = Block{Rows: k.tokens[q], Bytes: [3]int{k.tokens[q] * f.Row}}
		st.Recv[q] = Block{Rows: k.tokens[me], Bytes: [3]int{k.tokens[me] * f.Row}}
	}
	layOut(st.Send, -1) // every rank's tokens' sums side by side
}

// layOut sets the offsets of blocks that lie side by side in one buffer, in rank order,
// skip's left out (-1: none); the other blocks start at 0 (a low-latency block has a
// buffer of its own; a gathered send buffer is the same for every rank).
func layOut(bs []Block, skip int) {
	var off [3]int
	for q := range bs {
		b := &bs[q]
		b.Off = [3]int{}
		if q == skip {
			continue
		}
		b.Off = off
		for f := range off {
			off[f] += b.Bytes[f]
		}
	}
}

// extent is the bytes of a buffer that holds field f of every block of bs.
func extent(bs []Block, f int) int {
	n := 0
	for _, b := range bs {
		n = max(n, b.Off[f]+b.Bytes[f])
	}
	return n
}

func growBlocks(bs []Block, n int) []Block {
	if cap(bs) < n {
		return make([]Block, n)
	}
	return bs[:n]
}
