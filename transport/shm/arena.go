package shm

import (
	"fmt"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// peerArena is this rank's view of a peer's shared arena (obuf.NewSharedPool): the
// peer's memfd, taken with pidfd_getfd the first time the peer publishes a buffer from
// it, and one read-only mapping of the whole file, made again larger when the peer
// publishes beyond it. The file never shrinks (obuf punches freed ranges out and keeps
// its size), so a mapping stays valid however the peer's buffers come and go. Used only
// by the shared-area operations, one at a time; unmapped at Close.
type peerArena struct {
	fd     int // -1: not taken yet
	mem    []byte
	failed error // taking or mapping failed (logged once): the peer's buffers are read across instead
}

// arenaData returns n bytes at off of the peer's shared arena, or nil when they cannot be
// read in place: the arena could not be taken or mapped, which is logged the first time.
func (p *peer) arenaData(off uint64, n int) []byte {
	a := &p.arena
	end := off + uint64(n)
	if end > uint64(len(a.mem)) {
		if a.failed != nil {
			return nil
		}
		if a.failed = p.mapArena(end); a.failed != nil {
			p.t.log.Warn("moex shm: cannot map a rank's shared buffers; reading them across instead", "rank", p.t.rank, "peer", p.rank, "err", a.failed)
			return nil
		}
	}
	return a.mem[off:end:end]
}

// mapArena maps the peer's arena, which must hold at least end bytes.
func (p *peer) mapArena(end uint64) error {
	a := &p.arena
	if a.fd < 0 {
		fdw := atomic.LoadUint64(p.seg.u64(offArenaFD))
		switch {
		case fdw == 0:
			return fmt.Errorf("%w: rank %d published a shared buffer but no arena", transport.ErrProtocol, p.rank)
		case p.pidfd < 0:
			return fmt.Errorf("no pidfd for rank %d (pid %d)", p.rank, p.pid)
		}
		fd, err := pidfdGetfd(p.pidfd, int(fdw-1), 0)
		if err != nil {
			return fmt.Errorf("rank %d's arena (fd %d): %w", p.rank, fdw-1, ptraceErr("pidfd_getfd", p.rank, p.pid, err))
		}
		if !obuf.ArenaFile(fd) { // pidfd_getfd sets close-on-exec
			unix.Close(fd)
			return fmt.Errorf("%w: rank %d's fd %d is not a shared arena", transport.ErrProtocol, p.rank, fdw-1)
		}
		a.fd = fd
	}
	var st unix.Stat_t
	if err := unix.Fstat(a.fd, &st); err != nil {
		return fmt.Errorf("fstat of rank %d's arena: %w", p.rank, err)
	}
	if uint64(st.Size) < end {
		return fmt.Errorf("%w: rank %d published bytes up to %d of its %d-byte arena", transport.ErrProtocol, p.rank, end, st.Size)
	}
	mem, err := unix.Mmap(a.fd, 0, int(st.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("mapping rank %d's %d-byte arena: %w", p.rank, st.Size, err)
	}
	if a.mem != nil {
		_ = unix.Munmap(a.mem)
	}
	a.mem = mem
	return nil
}

// closeArena unmaps the peer's arena and closes its memfd.
func (p *peer) closeArena() {
	a := &p.arena
	if a.mem != nil {
		_ = unix.Munmap(a.mem)
		a.mem = nil
	}
	if a.fd >= 0 {
		unix.Close(a.fd)
		a.fd = -1
	}
}
