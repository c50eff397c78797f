package coll

// The two-level AlltoAll(v) for ranks on several hosts (algorithm Hier), as DeepEP's and
// UCCL's internode kernels move tokens: a rank sends what goes to the ranks of a remote
// host in one message, to one relay there, the rank of that host with the same local
// index (modulo the host's size); the relay hands each rank of its host its block over
// the host's own transport. A rank's blocks for the ranks of its own host go to them
// directly. A host's link then carries one message per rank and remote host, H-1 for a
// rank, where the flat algorithms send P-m (m ranks on its host), and the same bytes.
// The blocks arrive where the flat algorithms put them: the results are the same bytes.

// relayOf is the rank of host b that relays what rank o sends to b's ranks.
func (t topology) relayOf(o, b int) int {
	ms := t.members[b]
	return ms[t.local[o]%len(ms)]
}

// planAlltoAllHier appends the two-level schedule of rank r to pl (emptied first): l is
// r's layout and m(i, j) the bytes rank i sends rank j (every rank knows every entry:
// an AlltoAll, or an AlltoAllv planned from the whole count matrix). Step 0: blocks to
// the ranks of this host directly, to each remote host one message to its relay (packed
// in scratch unless the blocks lie in host order in the send buffer), and the bundles
// this rank relays received into scratch. Step 1: the relayed blocks handed on (this
// rank's own copied), and the blocks relayed to this rank received in place.
func planAlltoAllHier(pl *plan, t topology, r int, l vlayout, m func(i, j int) int) {
	pl.steps = pl.steps[:0]
	pl.algo = Hier
	home := t.hostOf[r]
	tmp := 0
	pl.stepAt(0)
	pl.stepAt(1)
	s0, s1 := &pl.steps[0], &pl.steps[1] // (after both: stepAt may move the steps)
	s0.mid = append(s0.mid, local{kind: lCopy, dst: region{bRecv, l.recvOff[r], l.recvLen[r]}, src: region{bSend, l.sendOff[r], l.sendLen[r]}})
	for _, d := range t.members[home] {
		if d == r {
			continue
		}
		s0.sends = append(s0.sends, xfer{d, 0, region{bSend, l.sendOff[d], l.sendLen[d]}})
		s0.recvs = append(s0.recvs, xfer{d, 0, region{bRecv, l.recvOff[d], l.recvLen[d]}})
	}
	// Bundles out: this rank's blocks for each remote host, in the host's rank order.
	for b, ms := range t.members {
		if b == home {
			continue
		}
		n, inOrder := 0, true
		for k, d := range ms {
			n += l.sendLen[d]
			if k > 0 && l.sendOff[d] != l.sendOff[ms[k-1]]+l.sendLen[ms[k-1]] {
				inOrder = false
			}
		}
		if n == 0 {
			continue
		}
		src := region{bSend, l.sendOff[ms[0]], n}
		if !inOrder {
			src = region{bTmp, tmp, n}
			o := tmp
			for _, d := range ms {
				s0.pre = append(s0.pre, local{kind: lCopy, dst: region{bTmp, o, l.sendLen[d]}, src: region{bSend, l.sendOff[d], l.sendLen[d]}})
				o += l.sendLen[d]
			}
			tmp += n
		}
		s0.sends = append(s0.sends, xfer{t.relayOf(r, b), 1, src})
	}
	// Bundles in (this rank relays them), then handed on.
	for o := range t.hostOf {
		if t.hostOf[o] == home || t.relayOf(o, home) != r {
			continue
		}
		n := 0
		for _, d := range t.members[home] {
			n += m(o, d)
		}
		if n == 0 {
			continue
		}
		s0.recvs = append(s0.recvs, xfer{o, 1, region{bTmp, tmp, n}})
		at := tmp
		for _, d := range t.members[home] {
			blk := region{bTmp, at, m(o, d)}
			at += blk.n
			switch {
			case blk.n == 0:
			case d == r:
				s1.mid = append(s1.mid, local{kind: lCopy, dst: region{bRecv, l.recvOff[o], l.recvLen[o]}, src: blk})
			default:
				s1.sends = append(s1.sends, xfer{d, uint32(2 + o), blk})
			}
		}
		tmp += n
	}
	// Blocks relayed to this rank by another rank of its host.
	for o := range t.hostOf {
		if t.hostOf[o] == home || l.recvLen[o] == 0 {
			continue
		}
		if q := t.relayOf(o, home); q != r {
			s1.recvs = append(s1.recvs, xfer{q, uint32(2 + o), region{bRecv, l.recvOff[o], l.recvLen[o]}})
		}
	}
	pl.tmp = tmp
}
