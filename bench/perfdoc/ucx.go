package main

import (
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
)

// ucx runs the low-latency step over UCX through one-sided windows (puts into the
// peers' registered memory, then a signal) and as tag messages, each a job of its own,
// over UCX's shared memory (RMA and atomics native) and its tcp (RMA emulated).
func (r *runner) ucx(w io.Writer) error {
	fmt.Fprintf(w, "## Over UCX: one-sided windows against tag messages\n\n")
	if err := exec.Command("pkg-config", "--exists", "ucx").Run(); err != nil {
		fmt.Fprintf(w, "Not measured: UCX (libucx-dev, pkg-config ucx) is not installed on this machine.\n\n")
		return nil
	}
	exe := filepath.Join(filepath.Dir(r.moex), "moex-ucx")
	if b, err := exec.Command("go", "build", "-tags", "ucx", "-buildvcs=true", "-o", exe, "./cmd/moex").CombinedOutput(); err != nil {
		return fmt.Errorf("building moex with -tags ucx: %v\n%s", err, b)
	}
	plain := r.moex
	r.moex = exe
	defer func() { r.moex = plain }()
	fmt.Fprintf(w, "`UCX_TLS=L [MOEX_WINDOWS=1] moex bench moe --transport ucx --mode low-latency --ranks P --tokens N\n")
	fmt.Fprintf(w, "--windows auto|off --json` (moex built with -tags ucx; `--windows compare` prints the same pair):\n")
	fmt.Fprintf(w, "mixtral-8x7b, f32 on the wire, identity experts; the step (dispatch, experts, combine; the slowest\n")
	fmt.Fprintf(w, "rank per stage, mean) with the exchanges through windows, then as tag messages (MOEX_WINDOWS=0).\n")
	fmt.Fprintf(w, "Through windows a rank puts each block into the receiver's registered memory, fences and signals\n")
	fmt.Fprintf(w, "a word there; the receiver polls its own memory and posts no receive. This host has no RDMA NIC:\n")
	fmt.Fprintf(w, "UCX's shared-memory lanes (sysv, posix, cma) do the puts as cross-memory copies and the signals as\n")
	fmt.Fprintf(w, "atomics in shared memory, and over tcp UCX emulates both with active messages (MOEX_WINDOWS=1 asks\n")
	fmt.Fprintf(w, "for windows there; by default such peers exchange tag messages). On a NIC the puts are the NIC's\n")
	fmt.Fprintf(w, "and no CPU of the receiver takes part.\n\n")
	fmt.Fprintf(w, "| UCX_TLS | ranks | tokens | windows: path | step us | tag messages: step us | tag / windows (above 1: windows faster) |\n")
	fmt.Fprintf(w, "| --- | --- | --- | --- | --- | --- | --- |\n")
	iters := fmt.Sprint(r.iters(128))
	for _, c := range []struct {
		tls   string
		env   []string
		ranks int
	}{{"sm", nil, 2}, {"sm", nil, 4}, {"tcp", []string{"MOEX_WINDOWS=1"}, 2}} {
		for _, tokens := range []string{"16", "128"} {
			args := []string{"--transport", "ucx", "--mode", "low-latency", "--ranks", fmt.Sprint(c.ranks), "--tokens", tokens, "--iters", iters}
			env := append([]string{"UCX_TLS=" + c.tls}, c.env...)
			one, _, err := r.benchEnv(env, append(args, "--windows", "auto")...)
			if err != nil {
				return err
			}
			two, _, err := r.benchEnv(env, append(args, "--windows", "off")...)
			if err != nil {
				return err
			}
			tls := c.tls
			if len(c.env) > 0 {
				tls += " (" + c.env[0] + ")"
			}
			fmt.Fprintf(w, "| %s | %d | %s | %s | %.0f | %.0f | %.2fx |\n", tls, c.ranks, tokens, one.Path, one.StepUS, two.StepUS, two.StepUS/max(one.StepUS, 1e-9))
			if r.quick {
				fmt.Fprintln(w)
				return nil
			}
		}
	}
	fmt.Fprintf(w, "\nHow to read them: over UCX's shared memory a put is the sender's store into the receiver's\n")
	fmt.Fprintf(w, "window (UCX allocates the windows in shared memory, and fast local completion keeps large puts\n")
	fmt.Fprintf(w, "from being emulated), and a tag message's rendezvous is one cross-memory read by the receiver: one\n")
	fmt.Fprintf(w, "copy either way, so the two paths meet, the windows ahead where the step is small (no matching,\n")
	fmt.Fprintf(w, "no rendezvous round trip). With more ranks than CPUs a receiver that polls its memory is woken by\n")
	fmt.Fprintf(w, "no event, where a tag receive wakes through UCX's event descriptor. Over tcp UCX emulates the puts\n")
	fmt.Fprintf(w, "and signals with active messages (ucx_perftest over loopback, 1 MiB: put 145 MB/s, tag 5.5 GB/s),\n")
	fmt.Fprintf(w, "which is why moex uses windows only where UCX's lanes do RMA unless MOEX_WINDOWS=1. The one-sided\n")
	fmt.Fprintf(w, "path is for RDMA NICs; between hosts moex picks UCX only where every peer has one.\n\n")
	return nil
}
