package topo

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// Print writes t the way `nvidia-smi topo -m` does: a matrix of how each GPU reaches
// each other GPU and each NIC, with each GPU's CPU and NUMA affinity, then the NUMA
// nodes, NICs and RDMA devices.
func (t *Topology) Print(w io.Writer) {
	fmt.Fprintf(w, "host %s\n\n", t.Host)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	phys := t.physicalNICs()
	if len(t.GPUs) > 0 {
		head := "\t"
		for i := range t.GPUs {
			head += fmt.Sprintf("GPU%d\t", i)
		}
		for _, n := range phys {
			head += n + "\t"
		}
		fmt.Fprintln(tw, head+"CPU affinity\tNUMA affinity\t")
		for i, g := range t.GPUs {
			row := fmt.Sprintf("GPU%d\t", i)
			for j := range t.GPUs {
				row += t.Link(i, j) + "\t"
			}
			for _, n := range phys {
				row += t.nicLink(g.NUMA, n) + "\t"
			}
			cpus, numa := "N/A", "N/A"
			if node := t.Node(g.NUMA); node != nil {
				cpus, numa = formatCPUs(node.CPUs), fmt.Sprint(g.NUMA)
			}
			fmt.Fprintln(tw, row+cpus+"\t"+numa+"\t")
		}
		tw.Flush()
		fmt.Fprintln(w, "\n  X = self, NV# = # NVLinks, NODE = PCIe within a NUMA node, SYS = across NUMA nodes, PHB = NUMA node unknown")
		if t.GPUs[0].P2P == nil {
			fmt.Fprintln(w, "  (GPUs from sysfs: NVLinks are not known, so none is shown; moex built with -tags nvml asks NVML)")
		}
		fmt.Fprintln(w)
		for _, g := range t.GPUs {
			p2p := strings.Join(g.P2P, " ")
			if g.P2P == nil {
				p2p = "unknown (sysfs; NVML's view needs a build with -tags nvml)"
			}
			fmt.Fprintf(w, "GPU%d %s %s, P2P read: %s\n", g.Index, g.Name, g.BusID, p2p)
		}
		fmt.Fprintln(w)
	} else {
		fmt.Fprintf(w, "GPUs: none (%s)\n\n", orNone(t.NoGPU))
	}
	for _, n := range t.NUMA {
		fmt.Fprintf(tw, "NUMA node %d\tCPUs %s\t\n", n.ID, formatCPUs(n.CPUs))
	}
	for _, n := range t.NICs {
		speed := "speed unknown"
		if n.Speed > 0 {
			speed = fmt.Sprintf("%g Gbit/s", float64(n.Speed)/1000)
		}
		where := fmt.Sprintf("NUMA node %d", n.NUMA)
		switch {
		case n.Virtual:
			where = "virtual"
		case n.NUMA < 0:
			where = "NUMA node unknown"
		}
		fmt.Fprintf(tw, "NIC %s\t%s\t%s\t\n", n.Name, speed, where)
	}
	for _, d := range t.RDMA {
		var ports []string
		for _, p := range d.Ports {
			ports = append(ports, fmt.Sprintf("port %d %s %s %s", p.Port, p.LinkLayer, p.State, p.Rate))
		}
		fmt.Fprintf(tw, "RDMA %s\tNUMA node %d\t%s\t\n", d.Name, d.NUMA, strings.Join(ports, "; "))
	}
	if len(t.RDMA) == 0 {
		fmt.Fprintln(tw, "RDMA\tnone\t\t")
	}
	tw.Flush()
}

func orNone(s string) string {
	if s == "" {
		return "NVML lists none"
	}
	return s
}

// physicalNICs names the RDMA devices and the NICs with a device behind them.
func (t *Topology) physicalNICs() []string {
	var out []string
	for _, d := range t.RDMA {
		out = append(out, d.Name)
	}
	for _, n := range t.NICs {
		if !n.Virtual {
			out = append(out, n.Name)
		}
	}
	return out
}

// nicLink is how a GPU on NUMA node gpuNode reaches the NIC or RDMA device named name.
func (t *Topology) nicLink(gpuNode int, name string) string {
	node := -1
	for _, d := range t.RDMA {
		if d.Name == name {
			node = d.NUMA
		}
	}
	if n := t.NIC(name); n != nil {
		node = n.NUMA
	}
	switch {
	case node < 0 || gpuNode < 0:
		return "PHB"
	case node == gpuNode:
		return "NODE"
	}
	return "SYS"
}

// formatCPUs writes 0,1,2,3,8 as 0-3,8.
func formatCPUs(cpus []int) string {
	var parts []string
	for i := 0; i < len(cpus); {
		j := i
		for j+1 < len(cpus) && cpus[j+1] == cpus[j]+1 {
			j++
		}
		if j > i {
			parts = append(parts, fmt.Sprintf("%d-%d", cpus[i], cpus[j]))
		} else {
			parts = append(parts, fmt.Sprint(cpus[i]))
		}
		i = j + 1
	}
	return strings.Join(parts, ",")
}
