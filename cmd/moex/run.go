package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/moex-ai/moex/internal/launch"
	"github.com/moex-ai/moex/transport/bootstrap"
)

// cmdRun: moex run -n N [--] prog args...
func cmdRun(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("moex run", flag.ContinueOnError)
	n := fs.Int("n", 1, "number of ranks")
	noPrefix := fs.Bool("no-prefix", false, "do not prefix output lines with [rank]")
	grace := fs.Duration("grace", 5*time.Second, "how long ranks get between SIGTERM and SIGKILL once the job stops")
	keepGoing := fs.Bool("keep-going", false, "let the other ranks run on when one fails (jobs that shrink their communicator and carry on); the exit code is still the first failed rank's")
	restarts := fs.Int("restarts", 0, fmt.Sprintf("replace a rank that fails with a new process that takes its rank over while the others run on (they admit it: coll.Comm.Admit), up to this many times (at most %d); the new process joins over shared memory (MOEX_TRANSPORT=shm where unset) or tcp (MOEX_TRANSPORT=tcp)", launch.MaxRestarts))
	nnodes := fs.Int("nnodes", 1, "nodes the job spans, -n ranks on each; one moex run (an agent) per node, each with its --node-rank and the same --rdzv")
	nodeRank := fs.Int("node-rank", 0, "this node's rank, 0 to --nnodes-1: it starts ranks node-rank*n to node-rank*n+n-1")
	rdzv := fs.String("rdzv", "", "etcd://host:port/job: the ranks meet in etcd (needed with --nnodes above 1; every agent exports the same MOEX_JOB_TOKEN); a rank that --restarts starts again takes its rank over through it")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: moex run -n N [--nnodes M --node-rank K --rdzv etcd://host:port/job] [--] prog [args...]\n\nStarts N ranks of prog on this host with MOEX_RANK, MOEX_WORLD_SIZE, MOEX_LOCAL_RANK,\nMOEX_LOCAL_SIZE, MOEX_ADDR and a fresh MOEX_JOB_TOKEN (with --rdzv, the exported one); prefixes\noutput with the rank; stops every rank when one fails (exit code: the failed rank's), unless\n--restarts starts it again; forwards Ctrl-C. With --nnodes, one moex run per node, as torchrun.")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return errHelp
		}
		return &usageError{err.Error()}
	}
	rest := fs.Args()
	if len(rest) == 0 {
		fs.Usage()
		return &usageError{"moex run: no program given"}
	}
	if *grace <= 0 || *grace > time.Hour {
		return &usageError{fmt.Sprintf("moex run: --grace %v: want above 0, at most an hour", *grace)}
	}
	if *restarts < 0 || *restarts > launch.MaxRestarts {
		return &usageError{fmt.Sprintf("moex run: --restarts %d: want 0 to %d", *restarts, launch.MaxRestarts)}
	}
	if *n < 1 || *n > launch.MaxRanks {
		return &usageError{fmt.Sprintf("moex run: -n %d: want 1 to %d ranks", *n, launch.MaxRanks)}
	}
	switch {
	case *nnodes < 1 || *nnodes > launch.MaxNodes || *nnodes**n > launch.MaxWorld:
		return &usageError{fmt.Sprintf("moex run: --nnodes %d: want 1 to %d, at most %d ranks in all", *nnodes, launch.MaxNodes, launch.MaxWorld)}
	case *nodeRank < 0 || *nodeRank >= *nnodes:
		return &usageError{fmt.Sprintf("moex run: --node-rank %d: want 0 to %d", *nodeRank, *nnodes-1)}
	case *nnodes > 1 && *rdzv == "":
		return &usageError{"moex run: --nnodes above 1 needs --rdzv etcd://host:port/job, where the agents' ranks meet"}
	}
	if *rdzv != "" {
		if u, err := bootstrap.ParseStoreURL(*rdzv); err != nil || u.Scheme != "etcd" || len(u.Path) < 2 {
			return &usageError{fmt.Sprintf("moex run: --rdzv %q: want etcd://host:port/job", *rdzv)}
		}
	}
	err := launch.Run(ctx, launch.Config{N: *n, Prog: rest[0], Args: rest[1:], NoPrefix: *noPrefix,
		KeepGoing: *keepGoing, Restarts: *restarts, ServeRegistry: serveRegistry, Grace: *grace,
		Nodes: *nnodes, NodeRank: *nodeRank, Rdzv: *rdzv, Stdout: os.Stdout, Stderr: os.Stderr})
	if err != nil && *rdzv != "" && !errors.As(err, new(*launch.RankError)) && !errors.Is(err, launch.ErrInterrupted) {
		return &usageError{err.Error()} // what the agent was given, not a rank, is wrong
	}
	return err
}

// serveRegistry serves a job's registry on loopback (moex run's ranks are on this host).
func serveRegistry(token string) (string, func() error, error) {
	srv, err := bootstrap.ServeStore("127.0.0.1:0", []byte(token), nil)
	if err != nil {
		return "", nil, err
	}
	return srv.Addr(), srv.Close, nil
}
