package ep

// Hooks is how package combine reaches the engine behind package dispatch's public
// types, which it cannot see: dispatch sets each in its init, as a func of its own types
// held as any (this package cannot name them), and combine asserts each once. Nothing
// else reads or writes them.
var Hooks struct {
	Handle         any // func(dispatch.Handle) Handle
	TwoLevelHandle any // func(dispatch.TwoLevelHandle) TwoLevelHandle
	// Engine: func(x any) any, the engine behind a *dispatch.Dispatcher[T]
	// (*Dispatcher[T]) or a *dispatch.TwoLevel[T] (*TwoLevel[T]); nil for anything else.
	Engine       any
	Schedule     any // func(*Schedule) dispatch.Schedule: a copy
	Config       any // func(Config) dispatch.Config
	EngineConfig any // func(dispatch.Config) Config
}
