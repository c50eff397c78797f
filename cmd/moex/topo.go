package main

import (
	"encoding/json"
	"flag"
	"log/slog"
	"os"

	"github.com/moex-ai/moex/transport/topo"
)

// cmdTopo: moex topo [--json] [--sys DIR]
func cmdTopo(args []string) error {
	fs := flag.NewFlagSet("moex topo", flag.ContinueOnError)
	asJSON := fs.Bool("json", false, "print the topology as JSON")
	sys := fs.String("sys", "/sys", "sysfs root to read (a copy of another host's, for instance)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	t := topo.Discover(topo.Options{Sys: *sys, GPUs: gpuSource(), Logger: slog.Default()})
	if *asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(t)
	}
	t.Print(os.Stdout)
	return nil
}
