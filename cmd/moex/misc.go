package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
)

func cmdEnv(args []string) error {
	fs := flag.NewFlagSet("moex env", flag.ContinueOnError)
	all := fs.Bool("all", false, "also the variables moex sets for its own processes")
	md := fs.Bool("markdown", false, "print the README's table")
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

// envMarkdown writes the user variables as the README's table.
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
