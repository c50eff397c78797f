// Package shared runs collectives of a whole communicator through the ranks' shared
// areas (transport.Areas: every rank's area of shared memory, mapped by every rank, that
// a transport such as shm lends), instead of through messages: each rank publishes its
// send buffer with one counter (copied into its own area, or, when larger, by address
// for the others to read across, or in its shared arena to be read in place), and every
// rank takes its blocks from the others straight away. AlltoAll, AlltoAllv, AllReduce
// and ReduceScatter; package coll picks them (the Shared algorithm) where every rank is
// on one host and the buffers fit.
//
// It owns the layout of the areas and the algorithms over them; the transport only
// lends the memory and what the algorithms need of the operating system (sleeping on a
// word, cross-memory attach, mapping a peer's arena).
package shared
