// Command moex is the command-line face of moex: a local launcher (run), benchmarks
// (bench coll, bench p2p, bench moe), and diagnostics (doctor, flow, topo, env).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"syscall"

	"github.com/moex-ai/moex/internal/launch"
	// Jobs that meet in etcd (MOEX_ADDR=etcd://host:port/job): the driver registers itself.
	_ "github.com/moex-ai/moex/transport/bootstrap/etcd"
)

const usage = `moex: Mixture-of-Experts expert parallelism for Go

usage:
  moex run -n N [--] prog [args...]   start N local ranks (like torchrun --standalone)
  moex bench coll [flags]             collective benchmark, nccl-tests style
  moex bench p2p [flags]              point-to-point bandwidth and latency
  moex bench moe [flags]              MoE dispatch/combine throughput (the main job)
  moex bench coalesce [flags]         one MoE dispatch sent five ways: tunes AlltoAll coalescing
  moex doctor [flags]                 what this machine and job would use, and why
  moex flow [flags]                   the data flow of one MoE step: primitives, links, bytes
  moex topo [--json]                  this host's GPUs, NUMA nodes, NICs, RDMA devices
  moex env                            the environment variables moex reads
  moex version                        moex's version, its Go and the build's settings

Run "moex <command> -h" for a command's flags.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if dir := os.Getenv("MOEX_CPUPROFILE"); dir != "" {
		// Profiling switch for benchmark ranks: one profile per process.
		f, err := os.Create(filepath.Join(dir, fmt.Sprintf("cpu-%s-%d.prof", os.Getenv("MOEX_RANK"), os.Getpid())))
		if err == nil {
			_ = pprof.StartCPUProfile(f)
			code := run(ctx, os.Args[1:])
			pprof.StopCPUProfile()
			f.Close()
			os.Exit(code)
		}
	}
	os.Exit(run(ctx, os.Args[1:]))
}

func run(ctx context.Context, args []string) int {
	if len(args) == 0 {
		fmt.Fprint(os.Stderr, usage)
		return 2
	}
	var err error
	switch args[0] {
	case "run":
		err = cmdRun(ctx, args[1:])
	case "bench":
		err = cmdBench(ctx, args[1:])
	case "doctor":
		err = cmdDoctor(ctx, args[1:])
	case "flow":
		err = cmdFlow(ctx, args[1:])
	case "env":
		err = cmdEnv(args[1:])
	case "topo":
		err = cmdTopo(args[1:])
	case "version", "-version", "--version":
		err = cmdVersion(args[1:])
	case "-h", "-help", "--help", "help":
		fmt.Print(usage)
		return 0
	default:
		fmt.Fprintf(os.Stderr, "moex: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
	return exitCode(err)
}

// usageError is a bad invocation: exit code 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

// parseFlags parses a command's flags: -h prints them and ends the command
// successfully (errHelp), a bad flag or a stray argument is a usage error.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return errHelp
		}
		return &usageError{err.Error()}
	}
	if fs.NArg() > 0 {
		return &usageError{fmt.Sprintf("%s: unexpected argument %q", fs.Name(), fs.Arg(0))}
	}
	return nil
}

// errHelp ends a command that printed its help: exit code 0.
var errHelp = errors.New("help printed")

func exitCode(err error) int {
	if err == nil || errors.Is(err, errHelp) {
		return 0
	}
	var re *launch.RankError
	if errors.As(err, &re) {
		fmt.Fprintln(os.Stderr, "moex:", err)
		if c := re.ExitCode(); c > 0 {
			return c
		}
		return 1
	}
	if errors.Is(err, launch.ErrInterrupted) {
		fmt.Fprintln(os.Stderr, "moex: interrupted")
		return 130
	}
	fmt.Fprintln(os.Stderr, "moex:", err)
	var ue *usageError
	if errors.As(err, &ue) {
		return 2
	}
	return 1
}
