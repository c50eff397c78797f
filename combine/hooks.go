package combine

import (
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/ep"
)

// hooks are package dispatch's ways to the engine behind its types (ep.Hooks), asserted
// once: dispatch is imported, so its init has set them.
var hooks = struct {
	handle         func(dispatch.Handle) ep.Handle
	twoLevelHandle func(dispatch.TwoLevelHandle) ep.TwoLevelHandle
	engine         func(any) any
	schedule       func(*ep.Schedule) dispatch.Schedule
	config         func(ep.Config) dispatch.Config
	engineConfig   func(dispatch.Config) ep.Config
}{
	ep.Hooks.Handle.(func(dispatch.Handle) ep.Handle),
	ep.Hooks.TwoLevelHandle.(func(dispatch.TwoLevelHandle) ep.TwoLevelHandle),
	ep.Hooks.Engine.(func(any) any),
	ep.Hooks.Schedule.(func(*ep.Schedule) dispatch.Schedule),
	ep.Hooks.Config.(func(ep.Config) dispatch.Config),
	ep.Hooks.EngineConfig.(func(dispatch.Config) ep.Config),
}
