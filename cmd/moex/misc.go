package main

import (
	"flag"
	"runtime"
	"runtime/debug"

	"fmt"
	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll/dtype"
	"io"
	"os"
	"strings"
	"text/tabwriter"
)

func cmdEnv(args []string) error {
	fs := flag.NewFlagSet("moex env", flag.ContinueOnError)
	all := fs.Bool("all", false, "also the variables moex sets for its own processes")
	md := fs.Bool("markdown", false, "print the table of docs/ENVIRONMENT.md")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *md {
		return envMarkdown(os.Stdout)
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "VARIABLE\tVALUE\tDEFAULT\tMEANING")
	for _, v := range envVars {
		if v.Internal && !*all {
			continue
		}
		val := os.Getenv(v.Name)
		if val == "" {
			val = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", v.Name, val, v.Default, v.Meaning)
	}
	return tw.Flush()
}

// envMarkdown writes the user variables as the table of docs/ENVIRONMENT.md.
func envMarkdown(w io.Writer) error {
	var b strings.Builder
	b.WriteString("| variable | default | meaning |\n|---|---|---|\n")
	for _, v := range envVars {
		if v.Internal {
			continue
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s |\n", v.Name, v.Default, strings.ReplaceAll(v.Meaning, "|", "\\|"))
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// cmdVersion: moex version. The module's version (a tagged release, or "(devel)" for a
// build from a checkout), the commit, the Go that built it, the build's tags, and the
// kernels the conversions and sums run on this CPU.
func cmdVersion(args []string) error {
	fs := flag.NewFlagSet("moex version", flag.ContinueOnError)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	version, tags := "unknown", ""
	if bi, ok := debug.ReadBuildInfo(); ok {
		version = bi.Main.Version
		for _, s := range bi.Settings {
			if s.Key == "-tags" {
				tags = s.Value
			}
		}
	}
	fmt.Printf("moex %s (commit %s)\n", version, bench.Commit())
	fmt.Printf("built with %s for %s/%s", runtime.Version(), runtime.GOOS, runtime.GOARCH)
	if tags != "" {
		fmt.Printf(", tags %s", tags)
	}
	fmt.Printf("\nkernels: %s\n", dtype.Kernels())
	return nil
}
