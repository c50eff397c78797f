// Package ep is the engine behind packages dispatch and combine: the pure planner that
// lays out each step's Schedule from the routing, the placement and the counts, and one
// object per mode (normal.go, lowlatency.go, gathered.go; twolevel.go composes two) that
// owns both halves of its protocol, the dispatch and the combine's way back, and moves
// what the schedule lists. New picks the mode once; the step's path does not ask it.
//
// Users never see this package: dispatch and combine define the types they hold
// (Dispatcher, Output, Handle, Combiner, ...) with their contracts, and reach the engine
// through them; combine reaches the engine behind dispatch's types through Hooks. The
// package imports coll and router, never dispatch, combine or models.
package ep
