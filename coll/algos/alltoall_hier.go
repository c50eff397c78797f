package algos

// The two-level AlltoAll(v) for ranks on several hosts (algorithm Hier), as DeepEP's and
// UCCL's internode kernels move tokens: a rank sends what goes to the ranks of a remote
// host in one message, to one relay there, the rank of that host with the same local
// index (modulo the host's size); the relay hands each rank of its host its block over
// the host's own transport. A rank's blocks for the ranks of its own host go to them
// directly. A host's link then carries one message per rank and remote host, H-1 for a
// rank, where the flat algorithms send P-m (m ranks on its host), and the same bytes.
// The blocks arrive where the flat algorithms put them: the results are the same bytes.

// relayOf is the rank of host b that relays what rank o sends to b's ranks.
func (t Topology) relayOf(o, b int) int {
	ms := t.Members[b]
	return ms[t.local[o]%len(ms)]
}

// planAlltoAllHier appends the two-level schedule of rank r to pl (emptied first): l is
// r's layout and m(i, j) the bytes rank i sends rank j (every rank knows every entry:
// an AlltoAll, or an AlltoAllv planned from the whole count matrix). Step 0: blocks to
// the ranks of this host directly, to each remote host one message to its relay (packed
// in scratch unless the blocks lie in host order in the send buffer), and the bundles
// this rank relays received into scratch. Step 1: the relayed blocks handed on (this
// rank's own copied), and the blocks relayed to this rank received in place.
func PlanAlltoAllHier(pl *Plan, t Topology, r int, l Vlayout, m func(i, j int) int) {
	pl.Steps = pl.Steps[:0]
	pl.Algo = Hier
	home := t.HostOf[r]
	tmp := 0
	pl.stepAt(0)
	pl.stepAt(1)
	s0, s1 := &pl.Steps[0], &pl.Steps[1] // (after both: stepAt may move the steps)
	s0.Mid = append(s0.Mid, Local{Kind: LCopy, Dst: Region{bRecv, l.RecvOff[r], l.RecvLen[r]}, Src: Region{bSend, l.SendOff[r], l.SendLen[r]}})
	for _, d := range t.Members[home] {
		if d == r {
			continue
		}
		s0.Sends = append(s0.Sends, Xfer{d, 0, Region{bSend, l.SendOff[d], l.SendLen[d]}})
		s0.Recvs = append(s0.Recvs, Xfer{d, 0, Region{bRecv, l.RecvOff[d], l.RecvLen[d]}})
	}
	// Bundles out: this rank's blocks for each remote host, in the host's rank order.
	for b, ms := range t.Members {
		if b == home {
			continue
		}
		n, inOrder := 0, true
		for k, d := range ms {
			n += l.SendLen[d]
			if k > 0 && l.SendOff[d] != l.SendOff[ms[k-1]]+l.SendLen[ms[k-1]] {
				inOrder = false
			}
		}
		if n == 0 {
			continue
		}
		src := Region{bSend, l.SendOff[ms[0]], n}
		if !inOrder {
			src = Region{BTmp, tmp, n}
			o := tmp
			for _, d := range ms {
				s0.Pre = append(s0.Pre, Local{Kind: LCopy, Dst: Region{BTmp, o, l.SendLen[d]}, Src: Region{bSend, l.SendOff[d], l.SendLen[d]}})
				o += l.SendLen[d]
			}
			tmp += n
		}
		s0.Sends = append(s0.Sends, Xfer{t.relayOf(r, b), 1, src})
	}
	// Bundles in (this rank relays them), then handed on.
	for o := range t.HostOf {
		if t.HostOf[o] == home || t.relayOf(o, home) != r {
			continue
		}
		n := 0
		for _, d := range t.Members[home] {
			n += m(o, d)
		}
		if n == 0 {
			continue
		}
		s0.Recvs = append(s0.Recvs, Xfer{o, 1, Region{BTmp, tmp, n}})
		at := tmp
		for _, d := range t.Members[home] {
			blk := Region{BTmp, at, m(o, d)}
			at += blk.N
			switch {
			case blk.N == 0:
			case d == r:
				s1.Mid = append(s1.Mid, Local{Kind: LCopy, Dst: Region{bRecv, l.RecvOff[o], l.RecvLen[o]}, Src: blk})
			default:
				s1.Sends = append(s1.Sends, Xfer{d, uint32(2 + o), blk})
			}
		}
		tmp += n
	}
	// Blocks relayed to this rank by another rank of its host.
	for o := range t.HostOf {
		if t.HostOf[o] == home || l.RecvLen[o] == 0 {
			continue
		}
		if q := t.relayOf(o, home); q != r {
			s1.Recvs = append(s1.Recvs, Xfer{q, uint32(2 + o), Region{bRecv, l.RecvOff[o], l.RecvLen[o]}})
		}
	}
	pl.Tmp = tmp
}
