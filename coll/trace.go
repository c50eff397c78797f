package coll

import (
	"encoding/json"
	"fmt"
	"github.com/moex-ai/moex/coll/algos"
	"os"
	"path/filepath"
	"time"
)

// Tracing (Config.TraceDir, MOEX_TRACE=dir) writes, when the communicator closes, one
// Chrome-trace JSON file per rank and communicator (open it in Perfetto or
// chrome://tracing): every operation as a slice with its algorithm and bytes, split into
// the wait for the last rank to arrive and the move after it, with the rank that came
// last. It needs the arrival all-gather, so it turns profiling on. An exchange (the MoE
// low-latency mode's) is a slice of its sends (Begin to Wait) then its wait, with the
// wait charged to the ranks it waited for. Timestamps are the ranks' wall clocks: files
// of ranks on one host line up exactly.

// maxTraceEvents bounds the memory a long job's trace takes; later operations are
// counted, not recorded.
const maxTraceEvents = 1 << 20

func (c *Comm) traceOp(pl *algos.Plan, entered time.Time, wait, move, skew time.Duration, last int) {
	c.prof.mu.Lock()
	defer c.prof.mu.Unlock()
	if len(c.prof.events) >= maxTraceEvents {
		c.prof.dropped++
		return
	}
	c.prof.events = append(c.prof.events, traceEvent{op: pl.Op, algo: pl.Algo, bytes: pl.Bytes,
		start: entered.UnixNano(), wait: wait, move: move, skew: skew, last: last})
}

// traceExchange records one exchange (XOp.Wait, profiled): begun (unix ns) when Begin
// started it, t0 (nanotime) when Wait started waiting, the wait, the rank that came last,
// and the ranks waited for in order (recordExchange), charged from arrived.
func (c *Comm) traceExchange(begun, t0 int64, wait time.Duration, last int, arrived []int64, order []int32) {
	waitStart := time.Now().UnixNano() - (nanotime() - t0)
	var waitFor map[string]float64
	prev := int64(0)
	for _, q := range order {
		if waitFor == nil {
			waitFor = make(map[string]float64, len(order))
		}
		waitFor[fmt.Sprint(q)] = float64(arrived[q]-prev) / 1e3
		prev = arrived[q]
	}
	c.prof.mu.Lock()
	defer c.prof.mu.Unlock()
	if len(c.prof.events) >= maxTraceEvents {
		c.prof.dropped++
		return
	}
	c.prof.events = append(c.prof.events, traceEvent{op: OpExchange, start: begun,
		move: time.Duration(max(0, waitStart-begun)), wait: wait, last: last, exchange: true, waitFor: waitFor})
}

// chromeEvent is one entry of the Chrome trace format's traceEvents.
type chromeEvent struct {
	Name string         `json:"name"`
	Cat  string         `json:"cat"`
	Ph   string         `json:"ph"`
	Ts   float64        `json:"ts"`  // microseconds
	Dur  float64        `json:"dur"` // microseconds
	Pid  int            `json:"pid"`
	Tid  uint32         `json:"tid"`
	Args map[string]any `json:"args,omitempty"`
}

// TracePath is the file Close writes this rank's trace to (empty without tracing).
func (c *Comm) TracePath() string {
	if c.cfg.TraceDir == "" {
		return ""
	}
	return filepath.Join(c.cfg.TraceDir, fmt.Sprintf("moex-rank%d-comm%08x.json", c.ranks[c.rank], c.id))
}

// writeTrace writes the recorded operations (Close calls it).
func (c *Comm) writeTrace() error {
	path := c.TracePath()
	if path == "" {
		return nil
	}
	c.prof.mu.Lock()
	events := c.prof.events
	dropped := c.prof.dropped
	c.prof.mu.Unlock()
	us := func(d time.Duration) float64 { return float64(d) / 1e3 }
	pid := c.ranks[c.rank]
	out := make([]chromeEvent, 0, 3*len(events)+1)
	out = append(out, chromeEvent{Name: "process_name", Ph: "M", Pid: pid, Tid: c.id,
		Args: map[string]any{"name": fmt.Sprintf("rank %d", pid)}})
	for _, e := range events {
		ts := float64(e.start) / 1e3
		name := e.op.String()
		if e.exchange { // its sends first, then the wait for the others' blocks
			args := map[string]any{"send_us": us(e.move), "wait_us": us(e.wait), "last_rank": e.last}
			wargs := map[string]any{"last_rank": e.last}
			if e.waitFor != nil {
				args["wait_for_us"], wargs["wait_for_us"] = e.waitFor, e.waitFor
			}
			out = append(out,
				chromeEvent{Name: name, Cat: "op", Ph: "X", Ts: ts, Dur: us(e.move + e.wait), Pid: pid, Tid: c.id, Args: args},
				chromeEvent{Name: "send", Cat: "move", Ph: "X", Ts: ts, Dur: us(e.move), Pid: pid, Tid: c.id},
				chromeEvent{Name: "wait", Cat: "wait", Ph: "X", Ts: ts + us(e.move), Dur: us(e.wait), Pid: pid, Tid: c.id, Args: wargs})
			continue
		}
		out = append(out,
			chromeEvent{Name: name, Cat: "op", Ph: "X", Ts: ts, Dur: us(e.wait + e.move), Pid: pid, Tid: c.id,
				Args: map[string]any{"algo": e.algo.String(), "bytes_sent": e.bytes, "wait_us": us(e.wait),
					"move_us": us(e.move), "skew_us": us(e.skew), "last_rank": e.last}},
			chromeEvent{Name: "wait", Cat: "wait", Ph: "X", Ts: ts, Dur: us(e.wait), Pid: pid, Tid: c.id,
				Args: map[string]any{"last_rank": e.last}},
			chromeEvent{Name: "move", Cat: "move", Ph: "X", Ts: ts + us(e.wait), Dur: us(e.move), Pid: pid, Tid: c.id})
	}
	doc := map[string]any{
		"traceEvents":     out,
		"displayTimeUnit": "ns",
		"otherData": map[string]any{"rank": c.rank, "world_rank": pid, "size": c.size, "comm": c.id,
			"transport": c.tr.Name(), "dropped_ops": dropped},
	}
	if err := os.MkdirAll(c.cfg.TraceDir, 0o755); err != nil {
		return fmt.Errorf("coll: writing the trace: %w", err)
	}
	b, err := json.Marshal(doc)
	if err != nil {
		return fmt.Errorf("coll: writing the trace: %w", err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("coll: writing the trace: %w", err)
	}
	return nil
}
