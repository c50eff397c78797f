// Package exchange is the Exchange: an AlltoAllv whose block sizes travel with the data,
// into buffers sized once, the primitive under the MoE low-latency mode. Where ranks map
// one another's memory (transport windows) a sender writes its block straight into its
// receiver's buffer and raises a flag there; with other peers blocks go as tagged
// messages into the same buffers.
//
// It runs on a communicator through the small Host interface it owns, which package
// coll's Comm gives it (coll.Comm.NewExchange); it imports no communicator.
package exchange
