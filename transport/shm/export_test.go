package shm

import "time"

// SetProgressNap sets how long the progress loop sleeps at most (see progressNap).
func SetProgressNap(d time.Duration) { progressNap = d }
