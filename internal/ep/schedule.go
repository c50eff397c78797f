package ep

// The planning half of a step: pure functions of the configuration and the row counts,
// which touch no transport. They lay out a Schedule; the modes' executors iterate it and
// move the bytes it says, Plan makes one per rank for moex flow and tests, and Stats and
// the Plan's byte matrices sum it.

// Schedule is one rank's part of a step: for every peer, the block this rank sends it and
// the block it receives from it, in the dispatch and in the combine, field by field.
type Schedule struct {
	Mode        Mode
	Rank, Ranks int
	// Control is the bytes every rank contributes to the step's control all-gather
	// before the dispatch (the normal and gathered modes' counts; 0 in the low-latency
	// mode, whose counts travel with the rows).
	Control  int
	Dispatch Stage
	Combine  Stage
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

// Sent and Received are the bytes this rank puts on the wire for its peers and takes
// from them in the stage (its own block aside).
func (st Stage) Sent(me int) int     { return sumOff(st.Send, me) }
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

// dispatchBlock is the block of n rows carrying m choices in cfg's mode (in place: the
// payload and scales are read where their sender staged them).
func dispatchBlock(mode Mode, f *Format, n, m int, inPlace bool) Block {
	b := Block{Rows: n, Choices: m}
	switch mode {
	case LowLatency:
		b.Bytes = [3]int{blockHeader + n*f.MetaBytes(0) + 8*m, n * f.Payload, n * f.ScaleBytes()}
		if inPlace {
			b.Bytes[1], b.Bytes[2], b.InPlace, b.Read = 0, 0, true, n*(f.Payload+f.ScaleBytes())
		}
	case Gathered: // n tokens, every choice with them
		b.Bytes = [3]int{n * f.GatheredMeta(), n * f.Payload, n * f.ScaleBytes()}
	default:
		b.Bytes[0] = blockHeader + n*f.RowBytes(0) + 8*m
	}
	return b
}

// combineBlock is the block of the way back that answers n rows carrying m choices: a
// header and the partial sums (or terms); in place, the header alone, the receiver
// reading the m outputs of termRow bytes where they were written.
func combineBlock(mode Mode, f *CombineFormat, n, m int, inPlace bool) Block {
	b := Block{Rows: n, Choices: m}
	switch {
	case mode == Gathered: // n: the receiver's tokens, a partial sum each
		b.Bytes[0] = n * f.Row
	case inPlace:
		b.Bytes[0], b.InPlace, b.Read = blockHeader, true, m*f.TermRow
	case mode == LowLatency:
		b.Bytes = [3]int{blockHeader, f.Block(n, m)}
	default:
		b.Bytes[0] = blockHeader + f.Block(n, m)
	}
	return b
}

// planDispatch lays out the dispatch stage of rank me from k.
func planDispatch(st *Stage, mode Mode, f *Format, me int, k *counts) {
	p := len(k.rowsTo)
	st.Fields = dispatchFields[mode]
	st.Send, st.Recv = growBlocks(st.Send, p), growBlocks(st.Recv, p)
	for q := 0; q < p; q++ {
		switch mode {
		case Gathered:
			st.Send[q] = dispatchBlock(mode, f, k.tokens[me], 0, false)
			st.Recv[q] = dispatchBlock(mode, f, k.tokens[q], 0, false)
		default:
			st.Send[q] = dispatchBlock(mode, f, k.rowsTo[q], k.choicesTo[q], k.sentInPlace)
			st.Recv[q] = dispatchBlock(mode, f, k.rowsFrom[q], k.choicesFrom[q], k.fromInPlace != nil && k.fromInPlace[q])
		}
		if q == me && mode == Normal { // an AlltoAllv keeps a rank's own rows where they are
			st.Send[q].Bytes, st.Recv[q].Bytes = [3]int{}, [3]int{}
		}
	}
	switch mode {
	case Normal:
		layOut(st.Send, me)
		layOut(st.Recv, me)
	case Gathered: // one send buffer for every rank; every rank's rows side by side
		layOut(st.Recv, -1)
	}
}

// planCombine lays out the combine stage of rank me: to each rank, the answers to the
// rows it sent (k.rowsFrom); from it, those to the rows this rank sent (k.rowsTo).
func planCombine(st *Stage, mode Mode, f *CombineFormat, me int, k *counts, inPlace bool) {
	p := len(k.rowsTo)
	st.Fields = combineFields[mode]
	st.Send, st.Recv = growBlocks(st.Send, p), growBlocks(st.Recv, p)
	for q := 0; q < p; q++ {
		switch mode {
		case Gathered:
			st.Send[q] = combineBlock(mode, f, k.tokens[q], 0, false)
			st.Recv[q] = combineBlock(mode, f, k.tokens[me], 0, false)
		default:
			st.Send[q] = combineBlock(mode, f, k.rowsFrom[q], k.choicesFrom[q], inPlace)
			st.Recv[q] = combineBlock(mode, f, k.rowsTo[q], k.choicesTo[q], inPlace)
		}
		if q == me && mode != Gathered { // a rank's own answers stay in its memory
			st.Send[q].Bytes, st.Recv[q].Bytes = [3]int{}, [3]int{}
			if mode == LowLatency {
				st.Send[q].Bytes[0], st.Recv[q].Bytes[0] = blockHeader, blockHeader
			}
		}
	}
	switch mode {
	case Normal:
		layOut(st.Send, me)
		layOut(st.Recv, me)
	case Gathered: // every rank's tokens' sums side by side; the reduced sum of this rank's
		layOut(st.Send, -1)
	}
}

var (
	dispatchFields = map[Mode][]string{
		Normal:     {"block"},
		LowLatency: {"header+meta", "payload", "scales"},
		Gathered:   {"meta", "payload", "scales"},
	}
	combineFields = map[Mode][]string{
		Normal:     {"block"},
		LowLatency: {"header", "partials"},
		Gathered:   {"partials"},
	}
)

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
