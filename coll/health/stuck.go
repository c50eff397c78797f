package health

import (
	"slices"
	"time"
)

// FindStuck follows the chain of waits from the ranks this rank waits for: it asks each
// (ask sends a probe; it returns false for a rank it cannot ask, such as this one),
// reads the replies, asks in turn the ranks they wait for, and returns the ranks at the
// end of the chain: those that did not answer within window (stopped, or cut off), else
// those that answered but are in no operation (busy elsewhere). Nil when every rank
// asked is alive and waiting (a cycle, or the window too short), or when done closes.
func FindStuck(waiting []int, window time.Duration, ask func(rank int) bool, replies <-chan Reply, done <-chan struct{}) []int {
	if len(waiting) == 0 {
		return nil
	}
	asked, answered := map[int]bool{}, map[int]Reply{}
	askOnce := func(w int) {
		if !asked[w] && ask(w) {
			asked[w] = true
		}
	}
	for _, w := range waiting {
		askOnce(w)
	}
	timer := time.NewTimer(window)
	defer timer.Stop()
wait:
	for len(answered) < len(asked) {
		select {
		case r := <-replies:
			if !asked[r.From] {
				continue
			}
			answered[r.From] = r
			for _, w := range r.Waiting {
				askOnce(w)
			}
		case <-timer.C:
			break wait
		case <-done:
			return nil
		}
	}
	var silent, idle []int
	for w := range asked {
		r, ok := answered[w]
		switch {
		case !ok:
			silent = append(silent, w)
		case !r.InOp:
			idle = append(idle, w)
		}
	}
	if len(silent) == 0 {
		silent = idle
	}
	slices.Sort(silent)
	return silent
}
