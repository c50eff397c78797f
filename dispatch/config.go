package dispatch

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/cespare/xxhash/v2"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// Out is the element type of the expert outputs and of the combined output.
type Out interface{ float32 | dtype.BFloat16 }

// String names the mode as ParseMode reads it.
func (m Mode) String() string {
	switch m {
	case Auto:
		return "auto"
	case Normal:
		return "normal"
	case LowLatency:
		return "low-latency"
	case Gathered:
		return "gathered"
	}
	return fmt.Sprintf("mode(%d)", int(m))
}

// ParseMode accepts "auto" (or ""), "normal", "low-latency" (or "ll") and "gathered".
func ParseMode(s string) (Mode, error) {
	switch s {
	case "auto", "":
		return Auto, nil
	case "normal":
		return Normal, nil
	case "low-latency", "lowlatency", "ll":
		return LowLatency, nil
	case "gathered", "agrs":
		return Gathered, nil
	}
	return 0, fmt.Errorf("%w: mode %q (want auto, normal, low-latency or gathered)", ErrConfig, s)
}

// BufferLimitError says that a step of the normal mode (or an Auto step in it) would need
// more memory on a rank than Config.MaxBufferBytes: every rank gets it in the same call,
// naming the first Rank over the limit, its Need and the Limit, before anything is sized
// or moved, and the communicator serves on. It matches ErrBufferLimit.
type BufferLimitError struct {
	Rank  int // the first rank over the limit
	Need  int // the bytes its buffers would take
	Limit int // Config.MaxBufferBytes
}

func (e *BufferLimitError) Error() string {
	return fmt.Sprintf("dispatch: the step needs %d bytes of buffers on rank %d, over Config.MaxBufferBytes (%d)", e.Need, e.Rank, e.Limit)
}

func (e *BufferLimitError) Unwrap() error { return ErrBufferLimit }

// CombineConfig is how the expert outputs go back. The zero Config sends partial sums in the
// outputs' type, read in place where every rank maps every rank's memory.
type CombineConfig struct {
	// PartialDType is the type of the partial sums (each rank's weighted sum of its
	// experts' outputs for a token) on the way back: F32, BF16, or, to halve the bytes
	// of bf16, FP8E4M3 (one scale per 128 elements) or I8 (one scale per row),
	// quantised once on the rank that sums them and added in float32 on the token's
	// rank (default: the type of the outputs). The gathered mode adds the partial sums
	// on the way, so it takes F32 or BF16 only. Where the combine reads the expert
	// outputs in place (see SendPartials), no partial sums travel and the outputs are
	// summed as the experts wrote them.
	PartialDType dtype.Type
	// SendPartials makes the low-latency combine send partial sums even where every rank
	// can read every rank's memory (inproc; shm on one host), where by default the ranks
	// that sent the tokens read the expert outputs in place (Combiner.Buffer).
	SendPartials bool
	// SumAtOrigin makes the combine send each expert output back as the expert wrote it,
	// in the type of the outputs, rather than each rank's partial sum of a token, and
	// the token's rank adds all of its terms in float32 in the order of its choices: the
	// bits one process computes, whatever the number of ranks and hosts and the
	// placement (the in-place combine sums so already, on one host). It costs bytes: a
	// row per (token, choice) comes back instead of one per (token, rank), and y is
	// copied at Start. Not in the gathered mode or on the two-level path, whose sums
	// are made on the way; not with CombineRows (the rows are summed already);
	// PartialDType, if set, must be the type of the outputs. With SendPartials the
	// outputs travel even where they could be read in place.
	SumAtOrigin bool
}

// Errors.
var (
	// ErrConfig: the configuration is invalid.
	ErrConfig = errors.New("dispatch: invalid configuration")
	// ErrInput: this rank's tokens or routing are invalid (details in the message).
	ErrInput = errors.New("dispatch: invalid input")
	// ErrCombineInput: this rank's expert outputs or output buffer have the wrong length.
	ErrCombineInput = errors.New("combine: invalid input")
	// ErrMismatch: ranks disagree on the configuration or the placement; every rank gets
	// it, naming one that differs.
	ErrMismatch = coll.ErrMismatch
	// ErrStale: a Handle or Output that does not describe a live dispatch of this
	// dispatcher: the zero Handle, another dispatcher's, one whose buffers a newer
	// dispatch reused, or one combined already (the error says which).
	ErrStale = errors.New("dispatch: not a live handle")
	// ErrBusy: a dispatch would reuse buffers still in use (InFlight results, the
	// oldest not waited for or pinned by a combine).
	ErrBusy = coll.ErrBusy
	// ErrWeights: expert weights of the wrong size (Migrate).
	ErrWeights = errors.New("dispatch: expert weights of the wrong size")
	// ErrBufferLimit: a step would need more memory than Config.MaxBufferBytes.
	ErrBufferLimit = errors.New("dispatch: buffers over the limit")
)

// Status codes: what a rank says of its own call in every block it sends, so that the
// others fail in the same call. Internal: PeerInputError turns them into errors.
const (
	codeOK      = iota
	codeShape   // tokens and routing disagree in shape
	codeRouting // invalid routing, or the rank abandoned the step
	codeTooMany // more tokens than MaxTokens
	codeStale   // combine: a stale, foreign or zero handle
	codeOutput  // combine: expert outputs or output of the wrong length
	codeWeights // Migrate: expert weights of the wrong size
	codeEnd
)

var codeErrs = [codeEnd]struct {
	err  error
	what string
}{
	codeOK:      {nil, "ok"},
	codeShape:   {ErrInput, "tokens and routing disagree in shape"},
	codeRouting: {ErrInput, "invalid routing, or the step abandoned"},
	codeTooMany: {ErrInput, "more tokens than MaxTokens"},
	codeStale:   {ErrStale, "a stale, foreign or zero dispatch handle"},
	codeOutput:  {ErrCombineInput, "buffers of the wrong length"},
	codeWeights: {ErrWeights, "expert weights of the wrong size"},
}

// codeOf is the status a rank sends for err, the reason it cannot take its part: what
// another rank reported, if err is that, else what err is.
func codeOf(err error) int {
	var pie *PeerInputError
	switch {
	case errors.As(err, &pie) && pie.code > codeOK && pie.code < codeEnd:
		return pie.code
	case errors.Is(err, ErrStale):
		return codeStale
	case errors.Is(err, ErrCombineInput):
		return codeOutput
	case errors.Is(err, ErrWeights):
		return codeWeights
	}
	return codeRouting
}

// PeerInputError says that another rank could not dispatch (or combine) its tokens:
// every rank returns an error in the same call, and the communicator stays usable.
// errors.Is matches it with ErrInput, and with what was wrong (ErrStale,
// ErrCombineInput, ErrWeights).
type PeerInputError struct {
	Rank int // the rank that could not take its part
	code int
}

// PeerInput is the error that rank's status code says.
func peerInput(rank, code int) *PeerInputError { return &PeerInputError{Rank: rank, code: code} }

func (e *PeerInputError) Error() string {
	what := "unknown error"
	if e.code > 0 && e.code < codeEnd {
		what = codeErrs[e.code].what
	}
	return fmt.Sprintf("dispatch: rank %d rejected its input (%s)", e.Rank, what)
}

// Is makes PeerInputError match ErrInput.
func (e *PeerInputError) Is(target error) bool { return target == ErrInput }

// Unwrap is what the rank found wrong (nil for an unknown code).
func (e *PeerInputError) Unwrap() error {
	if e.code > 0 && e.code < codeEnd {
		return codeErrs[e.code].err
	}
	return nil
}

// Defaults returns cfg as New[T] would use it: the wire type defaulting to T's, InFlight
// to 2, Align to 1, MaxLocalExperts to the placement's, and every field checked
// (ErrConfig).
func Defaults[T Act](cfg Config) (Config, error) {
	act := actType[T]()
	if cfg.WireDType == 0 {
		cfg.WireDType = act
	}
	if err := cfg.fill(); err != nil {
		return cfg, err
	}
	switch {
	case act == dtype.U8 && cfg.WireDType != dtype.U8:
		return cfg, fmt.Errorf("%w: opaque rows travel as they are (wire type u8), not %v", ErrConfig, cfg.WireDType)
	case act != dtype.U8 && cfg.WireDType == dtype.U8:
		return cfg, fmt.Errorf("%w: wire type u8 is for opaque rows (Dispatcher[byte])", ErrConfig)
	}
	return cfg, nil
}

// fill checks cfg and fills its defaults (the wire type is set).
func (cfg *Config) fill() error {
	if cfg.InFlight == 0 {
		cfg.InFlight = 2
	}
	if cfg.Align < 1 {
		cfg.Align = 1
	}
	if cfg.Mode == Auto && cfg.MaxTokens == 0 {
		cfg.MaxTokens = AutoMaxTokens
	}
	if (cfg.Mode == Auto || cfg.Mode == Normal) && cfg.MaxBufferBytes == 0 {
		cfg.MaxBufferBytes = DefaultMaxBufferBytes
	}
	switch {
	case cfg.Hidden < 1 || cfg.Hidden > 1<<24:
		return fmt.Errorf("%w: hidden size %d", ErrConfig, cfg.Hidden)
	case cfg.TopK < 1 || cfg.TopK > 64:
		return fmt.Errorf("%w: top-k %d (want 1..64)", ErrConfig, cfg.TopK)
	case cfg.WireDType != dtype.F32 && cfg.WireDType != dtype.BF16 && cfg.WireDType != dtype.FP8E4M3 && cfg.WireDType != dtype.I8 && cfg.WireDType != dtype.U8:
		return fmt.Errorf("%w: wire type %v (want f32, bf16, fp8 or int8)", ErrConfig, cfg.WireDType)
	case cfg.Mode != LowLatency && cfg.Mode != Auto && cfg.PushRows:
		return fmt.Errorf("%w: PushRows is for the low-latency mode, not the %v mode", ErrConfig, cfg.Mode)
	case cfg.Placement == nil:
		return fmt.Errorf("%w: no placement", ErrConfig)
	case cfg.TopK > cfg.Placement.Experts:
		return fmt.Errorf("%w: top-k %d with %d experts", ErrConfig, cfg.TopK, cfg.Placement.Experts)
	case cfg.Mode != Auto && cfg.Mode != Normal && cfg.Mode != LowLatency && cfg.Mode != Gathered:
		return fmt.Errorf("%w: mode %v", ErrConfig, cfg.Mode)
	case (cfg.Mode == LowLatency || cfg.Mode == Auto) && (cfg.MaxTokens < 1 || cfg.MaxTokens > MaxLowLatencyTokens):
		return fmt.Errorf("%w: the %v mode needs MaxTokens in 1..%d, not %d", ErrConfig, cfg.Mode, MaxLowLatencyTokens, cfg.MaxTokens)
	case cfg.MaxBufferBytes > MaxBufferBytesLimit:
		return fmt.Errorf("%w: MaxBufferBytes %d (at most %d)", ErrConfig, cfg.MaxBufferBytes, MaxBufferBytesLimit)
	case cfg.InFlight < 1 || cfg.InFlight > 16:
		return fmt.Errorf("%w: InFlight %d (want 1..16)", ErrConfig, cfg.InFlight)
	case cfg.Align > 1<<16:
		return fmt.Errorf("%w: alignment %d", ErrConfig, cfg.Align)
	case cfg.Quantized && cfg.WireDType != dtype.FP8E4M3 && cfg.WireDType != dtype.I8:
		return fmt.Errorf("%w: Quantized needs an fp8 or int8 wire, not %v", ErrConfig, cfg.WireDType)
	case cfg.MaxLocalExperts < 0 || cfg.MaxLocalExperts > cfg.Placement.Experts:
		return fmt.Errorf("%w: MaxLocalExperts %d (want 0 to the %d experts)", ErrConfig, cfg.MaxLocalExperts, cfg.Placement.Experts)
	case cfg.MaxLocalExperts > 0 && cfg.MaxLocalExperts < maxLocal(cfg.Placement):
		return fmt.Errorf("%w: MaxLocalExperts %d, but a rank holds %d experts", ErrConfig, cfg.MaxLocalExperts, maxLocal(cfg.Placement))
	}
	if cfg.MaxLocalExperts == 0 {
		cfg.MaxLocalExperts = maxLocal(cfg.Placement)
	}
	return nil
}

// CombineDefaults returns ccfg as NewCombiner[T] uses it beside a dispatcher of cfg: the
// partial sums' type defaulting to T's, every field checked (ErrConfig).
func CombineDefaults[T Out](cfg Config, ccfg CombineConfig) (CombineConfig, error) {
	return combineDefaults(cfg, ccfg, outType[T]())
}

// combineDefaults is CombineDefaults for outputs of type out, beside a dispatcher of cfg
// (defaults filled).
func combineDefaults(cfg Config, ccfg CombineConfig, out dtype.Type) (CombineConfig, error) {
	if ccfg.PartialDType == 0 {
		ccfg.PartialDType = out
	}
	switch p := ccfg.PartialDType; {
	case p != dtype.F32 && p != dtype.BF16 && p != dtype.FP8E4M3 && p != dtype.I8:
		return ccfg, fmt.Errorf("%w: partial sums of type %v (want f32, bf16, fp8 or int8)", ErrConfig, p)
	case cfg.Mode != LowLatency && cfg.Mode != Auto && ccfg.SendPartials:
		return ccfg, fmt.Errorf("%w: SendPartials is for the low-latency mode, not the %v mode", ErrConfig, cfg.Mode)
	case cfg.Mode == Gathered && ccfg.SumAtOrigin:
		return ccfg, fmt.Errorf("%w: SumAtOrigin in the gathered mode, whose reduce-scatter adds the partial sums on the way", ErrConfig)
	case cfg.Mode == Gathered && p != dtype.F32 && p != dtype.BF16:
		return ccfg, fmt.Errorf("%w: partial sums of type %v in the gathered mode, whose reduce-scatter adds them on the way (want f32 or bf16)", ErrConfig, p)
	case ccfg.SumAtOrigin && p != out:
		return ccfg, fmt.Errorf("%w: SumAtOrigin sends the outputs in their type %v, not the partial sums' %v", ErrConfig, out, p)
	}
	return ccfg, nil
}

// maxLocal is the most experts any rank of pl holds.
func maxLocal(pl *router.Placement) int {
	n := 0
	for _, l := range pl.Local {
		n = max(n, len(l))
	}
	return n
}

func actType[T Act]() dtype.Type {
	var z T
	switch any(z).(type) {
	case float32:
		return dtype.F32
	case dtype.BFloat16:
		return dtype.BF16
	}
	return dtype.U8
}

func outType[T Out]() dtype.Type { return actType[T]() }

// Fingerprint identifies what every rank must agree on to dispatch together: the
// format, the mode, the limits and the placement (every expert's replicas). Ranks whose
// fingerprints differ fail the dispatch with ErrMismatch.
func Fingerprint(cfg Config) uint64 {
	fp, _ := fingerprint(nil, cfg)
	return fp
}

// fingerprint is Fingerprint, encoding into buf (returned for reuse): one hash of one
// buffer, a few microseconds for hundreds of experts.
func fingerprint(buf []byte, cfg Config) (uint64, []byte) {
	buf = buf[:0]
	for _, v := range []int{cfg.Hidden, cfg.TopK, int(cfg.WireDType), int(cfg.Mode), cfg.MaxTokens, cfg.InFlight, b2i(cfg.PushRows), cfg.MaxLocalExperts, cfg.MaxBufferBytes} {
		buf = binary.LittleEndian.AppendUint64(buf, uint64(v))
	}
	buf = appendPlacement(buf, cfg.Placement)
	return xxhash.Sum64(buf), buf
}

// combineFingerprint is what the blocks of a combine carry: the dispatch's fingerprint
// and the combine's configuration, so that ranks that combine differently fail together.
func combineFingerprint(dispatchFP uint64, ccfg CombineConfig, out dtype.Type) uint64 {
	var b [40]byte
	binary.LittleEndian.PutUint64(b[0:], dispatchFP)
	binary.LittleEndian.PutUint64(b[8:], uint64(ccfg.PartialDType))
	binary.LittleEndian.PutUint64(b[16:], uint64(b2i(ccfg.SendPartials)))
	binary.LittleEndian.PutUint64(b[24:], uint64(b2i(ccfg.SumAtOrigin)))
	binary.LittleEndian.PutUint64(b[32:], uint64(out))
	return xxhash.Sum64(b[:])
}

// PlacementFingerprint identifies a placement: its kind and every expert's replicas.
func PlacementFingerprint(pl *router.Placement) uint64 {
	return xxhash.Sum64(appendPlacement(nil, pl))
}

// appendPlacement appends pl's encoding: its size, kind and every expert's owners.
func appendPlacement(buf []byte, pl *router.Placement) []byte {
	for _, v := range []int{pl.Experts, pl.Ranks, int(pl.Kind)} {
		buf = binary.LittleEndian.AppendUint64(buf, uint64(v))
	}
	for _, owners := range pl.Owners {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(len(owners)))
		for _, r := range owners {
			buf = binary.LittleEndian.AppendUint32(buf, uint32(r))
		}
	}
	return buf
}

// checkRouting validates a rank's routing against cfg (shapes, expert ids), returning
// the number of tokens.
func checkRouting(cfg Config, r *router.Routing) (int, error) {
	switch {
	case r == nil:
		return 0, fmt.Errorf("%w: nil routing", ErrInput)
	case r.T < 0:
		return 0, fmt.Errorf("%w: %d tokens", ErrInput, r.T)
	case r.K != cfg.TopK || len(r.Experts) != r.T*r.K || len(r.Weights) != r.T*r.K:
		return 0, fmt.Errorf("%w: routing with k=%d (%d choices, %d weights) for %d tokens, top-k %d", ErrInput, r.K, len(r.Experts), len(r.Weights), r.T, cfg.TopK)
	case r.E != cfg.Placement.Experts:
		return 0, fmt.Errorf("%w: routing over %d experts, placement of %d", ErrInput, r.E, cfg.Placement.Experts)
	}
	for i, e := range r.Experts {
		if e < -1 || int(e) >= r.E {
			return 0, fmt.Errorf("%w: token %d choice %d is expert %d (have %d)", ErrInput, i/r.K, i%r.K, e, r.E)
		}
	}
	return r.T, nil
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
