package main

import (
	"fmt"
	"os"
	"text/tabwriter"

	"github.com/moex-ai/moex/transport"
)

func cmdEnv(args []string) error {
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "VARIABLE\tMEANING\tVALUE")
	for _, v := range transport.EnvVars {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", v.Name, v.Meaning, os.Getenv(v.Name))
	}
	return tw.Flush()
}
