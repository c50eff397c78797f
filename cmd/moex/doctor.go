package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/internal/launch"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport/bootstrap"
	"github.com/moex-ai/moex/transport/topo"
)

// doctorReport is what `moex doctor` finds: facts about this machine, then, per link of
// a real job, the transport, its path and why, with a measured round trip and bandwidth.
type doctorReport struct {
	facts    [][2]string
	algos    [][2]string // the collective algorithms this job would run, by size
	links    []doctorLink
	warnings []string
}

type doctorLink struct {
	from, to   int
	host       int
	transport  string
	path, why  string
	rttUS, gbs float64 // measured from rank 0 (0: not measured)
}

func cmdDoctor(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("moex doctor", flag.ContinueOnError)
	ranks := fs.Int("ranks", 2, "ranks to start (ignored under a launcher: the job's ranks are used)")
	tr := fs.String("transport", "auto", "auto, tcp, shm or ucx (MOEX_TRANSPORT for the ranks)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	switch *tr {
	case "auto", "tcp", "shm", "ucx":
	default:
		return &usageError{fmt.Sprintf("--transport %q: want auto, tcp, shm or ucx", *tr)}
	}
	if *ranks > MaxRanks {
		return &usageError{fmt.Sprintf("--ranks %d: want 2 to %d", *ranks, MaxRanks)}
	}
	env, err := bootstrap.FromEnv()
	if err != nil {
		return err
	}
	if env.Launcher == "none" {
		// Not a rank: start the ranks, as processes of this host.
		if *ranks < 2 {
			return &usageError{fmt.Sprintf("--ranks %d: doctor needs at least 2 ranks", *ranks)}
		}
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		e := []string{}
		if os.Getenv("MOEX_TRANSPORT") == "" || *tr != "auto" {
			e = append(e, "MOEX_TRANSPORT="+*tr)
		}
		return launch.Run(ctx, launch.Config{N: *ranks, Prog: exe, Args: append([]string{"doctor"}, args...), NoPrefix: true, Env: e})
	}
	c, err := coll.Init(ctx, coll.Config{})
	if err != nil {
		return fmt.Errorf("moex doctor: the ranks could not start: %w", err)
	}
	defer c.Close()
	rep, err := diagnose(ctx, c)
	if err != nil {
		return err
	}
	if c.Rank() == 0 {
		rep.print(os.Stdout, c.Size(), env)
	}
	return nil
}

// diagnose runs on every rank: machine facts on rank 0, links everywhere, measurements
// between rank 0 and each peer in turn, then every rank's links gathered on rank 0.
func diagnose(ctx context.Context, c *coll.Comm) (*doctorReport, error) {
	rep := &doctorReport{}
	if c.Rank() == 0 {
		rep.machine(c)
		rep.collectives(c)
	}
	mine := c.Links()
	// Measure rank 0 <-> q, one peer at a time.
	rtt := make([]float64, c.Size())
	bw := make([]float64, c.Size())
	small := make([]byte, 8)
	big := make([]byte, 1<<20)
	const pings, blasts = 200, 32
	for q := 1; q < c.Size(); q++ {
		switch c.Rank() {
		case 0:
			for i := 0; i < 20; i++ { // warm-up
				if err := pingPong(ctx, c, small, q, true); err != nil {
					return nil, err
				}
			}
			t0 := time.Now()
			for i := 0; i < pings; i++ {
				if err := pingPong(ctx, c, small, q, true); err != nil {
					return nil, err
				}
			}
			rtt[q] = float64(time.Since(t0).Microseconds()) / pings
			t0 = time.Now()
			for i := 0; i < blasts; i++ {
				if err := coll.Send(ctx, c, big, q, 3); err != nil {
					return nil, err
				}
			}
			if _, err := coll.Recv(ctx, c, small[:1], q, 4); err != nil {
				return nil, err
			}
			bw[q] = float64(len(big)*blasts) / time.Since(t0).Seconds() / 1e9
		case q:
			for i := 0; i < 20+pings; i++ {
				if err := pingPong(ctx, c, small, 0, false); err != nil {
					return nil, err
				}
			}
			for i := 0; i < blasts; i++ {
				if _, err := coll.Recv(ctx, c, big, 0, 3); err != nil {
					return nil, err
				}
			}
			if err := coll.Send(ctx, c, small[:1], 0, 4); err != nil {
				return nil, err
			}
		}
	}
	// Gather the links on rank 0 (length, then text).
	text := encodeLinks(c.Rank(), mine)
	if c.Rank() != 0 {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(text)))
		if err := coll.Send(ctx, c, n[:], 0, 5); err != nil {
			return nil, err
		}
		return rep, coll.Send(ctx, c, text, 0, 6)
	}
	all := decodeLinks(text)
	for q := 1; q < c.Size(); q++ {
		var n [8]byte
		if _, err := coll.Recv(ctx, c, n[:], q, 5); err != nil {
			return nil, err
		}
		b := make([]byte, binary.LittleEndian.Uint64(n[:]))
		if _, err := coll.Recv(ctx, c, b, q, 6); err != nil {
			return nil, err
		}
		all = append(all, decodeLinks(b)...)
	}
	for i := range all {
		if all[i].from == 0 && all[i].to > 0 {
			all[i].rttUS, all[i].gbs = rtt[all[i].to], bw[all[i].to]
		}
	}
	rep.links = all
	rep.warn(c)
	return rep, nil
}

func pingPong(ctx context.Context, c *coll.Comm, b []byte, peer int, first bool) error {
	if first {
		if err := coll.Send(ctx, c, b, peer, 1); err != nil {
			return err
		}
		_, err := coll.Recv(ctx, c, b, peer, 2)
		return err
	}
	if _, err := coll.Recv(ctx, c, b, peer, 1); err != nil {
		return err
	}
	return coll.Send(ctx, c, b, peer, 2)
}

// encodeLinks writes one line per peer: from, to, host, transport, path, why (tab
// separated; the fields hold no tabs or newlines).
func encodeLinks(from int, ls []coll.Link) []byte {
	var sb strings.Builder
	clean := strings.NewReplacer("\t", " ", "\n", " ")
	for _, l := range ls {
		if l.Peer == from {
			continue
		}
		fmt.Fprintf(&sb, "%d\t%d\t%d\t%s\t%s\t%s\n", from, l.Peer, l.Host, clean.Replace(l.Transport), clean.Replace(l.Path), clean.Replace(l.Why))
	}
	return []byte(sb.String())
}

func decodeLinks(b []byte) []doctorLink {
	var out []doctorLink
	for _, line := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		f := strings.Split(line, "\t")
		if len(f) != 6 {
			continue
		}
		var l doctorLink
		fmt.Sscan(f[0], &l.from)
		fmt.Sscan(f[1], &l.to)
		fmt.Sscan(f[2], &l.host)
		l.transport, l.path, l.why = f[3], f[4], f[5]
		out = append(out, l)
	}
	return out
}

// collectives says which algorithm the job's communicator would run per operation and
// size, and how its ranks sit on hosts (hierarchical algorithms need several hosts with
// the same number of ranks each).
func (r *doctorReport) collectives(c *coll.Comm) {
	add := func(k, v string) { r.algos = append(r.algos, [2]string{k, v}) }
	perHost := map[int]int{}
	for q := 0; q < c.Size(); q++ {
		perHost[c.Host(q)]++
	}
	counts := make([]string, 0, len(perHost))
	for h := 0; h < c.Hosts(); h++ {
		counts = append(counts, strconv.Itoa(perHost[h]))
	}
	add("hosts", fmt.Sprintf("%d (ranks per host: %s)", c.Hosts(), strings.Join(counts, ", ")))
	sizes := []int{8, 64 << 10, 1 << 20, 64 << 20}
	for _, op := range []coll.OpKind{coll.OpAllReduce, coll.OpAllGather, coll.OpAlltoAll} {
		var parts []string
		for _, n := range sizes {
			parts = append(parts, fmt.Sprintf("%s %v", humanBytes(n), c.Algorithm(op, n)))
		}
		what := "buffer"
		if op != coll.OpAllReduce {
			what = "block per rank"
		}
		add(op.String(), strings.Join(parts, ", ")+" ("+what+")")
	}
}

// sharedBuffers says whether obuf.Shared can hand out shared memory here, and what it is
// for.
func sharedBuffers() string {
	b := obuf.Shared.Get(1)
	defer b.Release()
	if !b.Shared() {
		return fmt.Sprintf("unavailable (%v): obuf.Shared hands out private buffers", obuf.SharedErr())
	}
	return fmt.Sprintf("obuf.Shared works (memfd); over shm, send buffers of %s and more from it are read in place by the other ranks (AlltoAll(v), AllGather, the MoE dispatch and combine); shared-memory huge pages: %s",
		humanBytes(bootstrap.HostFacts().SharedMin), readTrim("/sys/kernel/mm/transparent_hugepage/shmem_enabled"))
}

func humanBytes(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

// machine collects the facts about this host that decide how fast ranks talk.
func (r *doctorReport) machine(c *coll.Comm) {
	add := func(k, v string) { r.facts = append(r.facts, [2]string{k, v}) }
	local := bench.HostRanks(c)
	cpus := runtime.NumCPU()
	add("cpus", fmt.Sprintf("%d (GOMAXPROCS %d); %d rank(s) of this job on this host", cpus, runtime.GOMAXPROCS(0), local))
	poll := os.Getenv("MOEX_POLL")
	if poll == "" {
		poll = "adaptive"
	}
	switch {
	case busypoll.Oversubscribed(local) && poll != "block":
		add("polling", poll+"; ranks outnumber cores: receivers yield to the kernel instead of spinning, then park")
		r.warnings = append(r.warnings, fmt.Sprintf("%d ranks on %d cores: every wait costs a kernel wake-up; expect latencies in the tens of microseconds", local, cpus))
	default:
		add("polling", poll+" (MOEX_POLL); receivers spin up to "+spinUS()+", then park")
	}
	if advice := bench.SharedCPUsAdvice(c.Transport().Name(), runtime.GOMAXPROCS(0), cpus, local); advice != "" {
		r.warnings = append(r.warnings, advice)
	}
	add("cpu idle", cpuIdle())
	add("SO_BUSY_POLL", "net.core.busy_poll="+sysctl("net/core/busy_poll")+" busy_read="+sysctl("net/core/busy_read")+" (moex sets it per socket; see the tcp paths below)")
	facts := bootstrap.HostFacts()
	var st unix.Statfs_t
	if unix.Statfs(facts.ShmDir, &st) == nil {
		add("/dev/shm", fmt.Sprintf("%.1f GiB free", float64(st.Bavail)*float64(st.Bsize)/(1<<30)))
	}
	add("huge pages", "transparent: "+readTrim("/sys/kernel/mm/transparent_hugepage/enabled")+" (obuf backs buffers from 256 KiB with MADV_HUGEPAGE mappings; shm's single copy across, process_vm_readv, runs about twice as fast from them as from 4 KiB pages)")
	add("shared buffers", sharedBuffers())
	add("ptrace", ptraceFact(readTrim("/proc/sys/kernel/yama/ptrace_scope")))
	add("shm segments", fmt.Sprintf("%d stale in %s (left by crashed jobs; removed when a job starts)", facts.StaleSegments, facts.ShmDir))
	tp := topo.Discover(topo.Options{GPUs: gpuSource()})
	var nodes []string
	for _, n := range tp.NUMA {
		nodes = append(nodes, fmt.Sprintf("node %d: %d CPUs", n.ID, len(n.CPUs)))
	}
	add("NUMA", orDefault(strings.Join(nodes, "; "), "not reported")+" (moex topo; MOEX_CPU_BIND=numa binds a rank to the node of its GPU or NIC)")
	var nics []string
	for _, n := range tp.NICs {
		if !n.Virtual {
			nics = append(nics, fmt.Sprintf("%s %g Gbit/s node %d", n.Name, float64(n.Speed)/1000, n.NUMA))
		}
	}
	add("NICs", orDefault(strings.Join(nics, "; "), "no physical interface (virtual ones only)"))
	if len(tp.RDMA) == 0 {
		add("RDMA devices", "none (/sys/class/infiniband is empty): between hosts, traffic goes over TCP")
	} else {
		var names []string
		for _, d := range tp.RDMA {
			names = append(names, d.Name)
		}
		add("RDMA devices", strings.Join(names, " "))
		if !facts.UCX {
			r.warnings = append(r.warnings, "RDMA devices are present but this moex was built without UCX: build with -tags ucx (libucx-dev) to use them")
		}
	}
	if len(tp.GPUs) == 0 {
		add("GPUs", "none listed ("+orDefault(tp.NoGPU, "none listed")+")")
	} else {
		add("GPUs", fmt.Sprintf("%d (%s); moex topo prints their links", len(tp.GPUs), tp.GPUs[0].Name))
	}
	if facts.UCX {
		add("UCX", "built, UCX "+facts.UCXVersion+"; UCX_TLS="+os.Getenv("UCX_TLS"))
	} else {
		add("UCX", "not built (go build -tags ucx, with libucx-dev, for RDMA and GPU memory)")
	}
}

// warn adds the warnings that the links themselves raise, one per kind, naming the links.
func (r *doctorReport) warn(c *coll.Comm) {
	kinds := []struct {
		match func(l doctorLink) bool
		say   string
	}{
		{func(l doctorLink) bool { return strings.Contains(l.path, "fell back to TCP") }, "UCX runs over TCP, not RDMA"},
		{func(l doctorLink) bool { return strings.HasPrefix(l.path, "tcp") && hostOf(r.links, l.from) == l.host },
			"ranks on one host talk over tcp (MOEX_TRANSPORT=tcp?): shared memory is several times faster"},
		{func(l doctorLink) bool { return strings.Contains(l.path, "ring copies") },
			"shared memory without the single copy (large messages are copied twice, through the rings)"},
	}
	for _, k := range kinds {
		var pairs []string
		for _, l := range r.links {
			if l.from < l.to && k.match(l) {
				pairs = append(pairs, fmt.Sprintf("%d-%d", l.from, l.to))
			}
		}
		if len(pairs) > 0 {
			if len(pairs) > 8 {
				pairs = append(pairs[:8], fmt.Sprintf("and %d more", len(pairs)-8))
			}
			r.warnings = append(r.warnings, k.say+": "+strings.Join(pairs, " "))
		}
	}
}

func hostOf(ls []doctorLink, rank int) int {
	for _, l := range ls {
		if l.to == rank {
			return l.host
		}
	}
	return -1
}

func (r *doctorReport) print(w io.Writer, size int, env bootstrap.Env) {
	fmt.Fprintf(w, "# moex doctor: %d ranks, launcher %s, MOEX_TRANSPORT=%s\n\n", size, env.Launcher, orDefault(env.Transport, "auto"))
	fmt.Fprintln(w, "this host (rank 0)")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, f := range r.facts {
		fmt.Fprintf(tw, "  %s\t%s\n", f[0], f[1])
	}
	tw.Flush()
	fmt.Fprintln(w, "\nlinks (round trip of 8 B and bandwidth of 1 MiB messages, measured from rank 0)")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  from\tto\thost\ttransport\trtt (us)\tGB/s\tpath")
	for _, l := range r.links {
		rtt, gbs := "", ""
		if l.rttUS > 0 {
			rtt, gbs = fmt.Sprintf("%.1f", l.rttUS), fmt.Sprintf("%.2f", l.gbs)
		}
		fmt.Fprintf(tw, "  %d\t%d\t%d\t%s\t%s\t%s\t%s\n", l.from, l.to, l.host, l.transport, rtt, gbs, l.path)
	}
	tw.Flush()
	if len(r.algos) > 0 {
		fmt.Fprintln(w, "\ncollectives (what the cost model picks on this job's ranks; MOEX_ALGO overrides)")
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		for _, a := range r.algos {
			fmt.Fprintf(tw, "  %s\t%s\n", a[0], a[1])
		}
		tw.Flush()
	}
	whys := map[string]bool{}
	fmt.Fprintln(w, "\nwhy")
	for _, l := range r.links {
		if !whys[l.why] {
			whys[l.why] = true
			fmt.Fprintf(w, "  %s\n", l.why)
		}
	}
	if len(r.warnings) > 0 {
		fmt.Fprintln(w, "\nwarnings")
		for _, s := range r.warnings {
			fmt.Fprintf(w, "  - %s\n", s)
		}
	}
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

func spinUS() string {
	if v := os.Getenv("MOEX_SPIN_US"); v != "" {
		return v + "us"
	}
	return "1000us"
}

// cpuIdle says how an idle CPU waits, which is what a parked rank's wake-up costs: a CPU
// that halts at once (a virtual machine's haltpoll with guest_halt_poll_ns=0, or the
// default halt) leaves the wake-up to the hypervisor, which on the 2-CPU VM moex is
// measured on took 0.6-1 ms per park (the reason waiters spin up to MOEX_SPIN_US first).
func cpuIdle() string {
	drv := readTrim("/sys/devices/system/cpu/cpuidle/current_driver")
	if drv == "" {
		return "unknown (no cpuidle in /sys)"
	}
	s := "driver " + drv
	if gov := readTrim("/sys/devices/system/cpu/cpuidle/current_governor"); gov != "" {
		s += ", governor " + gov
	}
	if ns := readTrim("/sys/module/haltpoll/parameters/guest_halt_poll_ns"); ns != "" {
		s += ", guest_halt_poll_ns=" + ns
		if ns == "0" {
			s += " (an idle CPU halts at once: a parked rank wakes when the hypervisor runs its CPU again)"
		}
	}
	return s
}

func sysctl(name string) string { return orDefault(readTrim("/proc/sys/"+name), "?") }

func readTrim(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// ptraceFact says whether the ranks of a host can read one another (shm's single copy,
// process_vm_readv, and its shared buffers and regrow, pidfd_getfd), given Yama's
// ptrace_scope ("" without Yama).
func ptraceFact(scope string) string {
	switch scope {
	case "":
		return "no Yama: processes of one user read one another (shm's single copy, process_vm_readv, and pidfd_getfd work)"
	case "0":
		return "kernel.yama.ptrace_scope=0: processes of one user read one another"
	case "1":
		return "kernel.yama.ptrace_scope=1: only descendants may attach; every moex rank lets its user's processes read it (PR_SET_PTRACER_ANY, as Open MPI's CMA component does)"
	}
	return "kernel.yama.ptrace_scope=" + scope + ": no process may grant its peers: shm's large messages go through the rings (one more copy), a shared buffer is copied instead of read in place, and a lost rank cannot be taken over over shm (use tcp); set it to 1 (sysctl kernel.yama.ptrace_scope=1) for the single copy"
}
