package provision

import (
	"sync"
	"time"
)

// queue is a per-host work queue: a host is queued at most once, is
// handed to one worker at a time (a host queued while being worked on is
// handed out again when the worker is done), and may be queued for later.
type queue struct {
	mu         sync.Mutex
	cond       *sync.Cond
	order      []string
	queued     map[string]bool
	processing map[string]bool
	dirty      map[string]bool
	timers     map[string]*delayed
	closed     bool
}

type delayed struct {
	at    time.Time
	timer *time.Timer
}

func newQueue() *queue {
	q := &queue{
		queued:     map[string]bool{},
		processing: map[string]bool{},
		dirty:      map[string]bool{},
		timers:     map[string]*delayed{},
	}
	q.cond = sync.NewCond(&q.mu)
	return q
}

// add queues name now.
func (q *queue) add(name string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.addLocked(name)
}

func (q *queue) addLocked(name string) {
	if q.closed {
		return
	}
	if q.processing[name] {
		q.dirty[name] = true
		return
	}
	if q.queued[name] {
		return
	}
	q.queued[name] = true
	q.order = append(q.order, name)
	q.cond.Signal()
}

// addAfter queues name after d. Only the earliest pending time of a host
// is kept.
func (q *queue) addAfter(name string, d time.Duration, now time.Time) {
	if d <= 0 {
		q.add(name)
		return
	}
	at := now.Add(d)
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return
	}
	if t, ok := q.timers[name]; ok {
		if !at.Before(t.at) {
			return
		}
		t.timer.Stop()
	}
	dl := &delayed{at: at}
	dl.timer = time.AfterFunc(d, func() {
		q.mu.Lock()
		defer q.mu.Unlock()
		if q.timers[name] == dl {
			delete(q.timers, name)
		}
		q.addLocked(name)
	})
	q.timers[name] = dl
}

// get blocks until a host is queued and marks it processing; ok is false
// once the queue is closed.
func (q *queue) get() (string, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.order) == 0 && !q.closed {
		q.cond.Wait()
	}
	if q.closed {
		return "", false
	}
	name := q.order[0]
	q.order[0] = ""
	q.order = q.order[1:]
	delete(q.queued, name)
	q.processing[name] = true
	return name, true
}

// done ends the processing of name; a host queued meanwhile is queued
// again.
func (q *queue) done(name string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	delete(q.processing, name)
	if q.dirty[name] {
		delete(q.dirty, name)
		q.addLocked(name)
	}
}

// forget drops a pending delayed add of name (a deleted host).
func (q *queue) forget(name string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if t, ok := q.timers[name]; ok {
		t.timer.Stop()
		delete(q.timers, name)
	}
}

// close wakes every waiting worker; later adds are ignored.
func (q *queue) close() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.closed = true
	for _, t := range q.timers {
		t.timer.Stop()
	}
	q.timers = map[string]*delayed{}
	q.cond.Broadcast()
}

// len is the number of hosts waiting for a worker.
func (q *queue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.order)
}
