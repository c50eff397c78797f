package main

import (
	"os"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// progressDelay is how long a run goes quietly before its progress bar appears: short
// runs print nothing extra.
const progressDelay = 2 * time.Second

// progress draws a bar on stderr for a run that lasts longer than progressDelay, when
// stderr is a terminal (never in pipes, logs or CI). Before the first count it spins;
// set updates it from any goroutine; done clears it. A nil *progress does nothing.
type progress struct {
	mu          sync.Mutex
	desc        string
	n, all      int
	bar         *progressbar.ProgressBar
	stop, ended chan struct{}
}

// newProgress starts a progress display for desc; it returns nil where stderr is not a
// terminal.
func newProgress(desc string) *progress {
	if !term.IsTerminal(int(os.Stderr.Fd())) || os.Getenv("TERM") == "dumb" {
		return nil
	}
	p := &progress{desc: desc, all: -1, stop: make(chan struct{}), ended: make(chan struct{})}
	go p.run()
	return p
}

func (p *progress) run() {
	defer close(p.ended)
	select {
	case <-p.stop:
		return
	case <-time.After(progressDelay):
	}
	tick := time.NewTicker(150 * time.Millisecond)
	defer tick.Stop()
	for {
		p.mu.Lock()
		if p.bar == nil || (p.all > 0 && p.bar.GetMax() != p.all) {
			if p.bar != nil {
				_ = p.bar.Clear()
			}
			p.bar = progressbar.NewOptions(p.all, progressbar.OptionSetWriter(os.Stderr), progressbar.OptionSetDescription(p.desc),
				progressbar.OptionClearOnFinish(), progressbar.OptionShowCount(), progressbar.OptionSetElapsedTime(true),
				progressbar.OptionSetWidth(30), progressbar.OptionThrottle(100*time.Millisecond))
		}
		if p.all > 0 {
			_ = p.bar.Set(p.n)
		} else {
			_ = p.bar.Add(1) // a spinner
		}
		p.mu.Unlock()
		select {
		case <-p.stop:
			p.mu.Lock()
			_ = p.bar.Finish()
			_ = p.bar.Clear()
			p.mu.Unlock()
			return
		case <-tick.C:
		}
	}
}

// set records that done of all steps are done.
func (p *progress) set(done, all int) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.n, p.all = done, all
	p.mu.Unlock()
}

// describe names the current phase.
func (p *progress) describe(desc string) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.desc = desc
	if p.bar != nil {
		p.bar.Describe(desc)
	}
	p.mu.Unlock()
}

// done ends the display and clears it.
func (p *progress) done() {
	if p == nil {
		return
	}
	close(p.stop)
	<-p.ended
}
