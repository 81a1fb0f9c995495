package store

import (
	"context"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// cacheWatchBuffer is how many changes a Cache's watcher may fall behind
// before it is dropped (its channel ends with Unavailable: watch again).
const cacheWatchBuffer = 1024

// cacheWatcher is one Watch of a Cache.
type cacheWatcher struct {
	buf  chan WatchEvent
	lost chan struct{} // closed when dropped
}

// notify passes ev to every watcher; c.mu held. A watcher whose buffer is
// full is dropped.
func (v *view) notify(ev WatchEvent) {
	for w := range v.watchers {
		select {
		case w.buf <- ev:
		default:
			delete(v.watchers, w)
			close(w.lost)
		}
	}
}

// loseAll drops every watcher (the Cache listed again: changes may have
// been missed); c.mu held.
func (v *view) loseAll() {
	for w := range v.watchers {
		delete(v.watchers, w)
		close(w.lost)
	}
}

// Watch streams the changes the Cache applies from now on, in order, as
// Store.Watch does (Put with the encoded resource, Delete), from memory:
// many watchers cost one etcd watch. The channel closes when ctx ends. A
// watcher that falls cacheWatchBuffer changes behind, or a Cache that
// lists again (its etcd watch's history was compacted), ends the channel
// with one event whose Err is Unavailable: watch again. The Value bytes
// are shared: do not change them.
func (c *Cache) Watch(ctx context.Context) <-chan WatchEvent {
	w := &cacheWatcher{buf: make(chan WatchEvent, cacheWatchBuffer), lost: make(chan struct{})}
	c.mu.Lock()
	c.view.watchers[w] = struct{}{}
	c.mu.Unlock()
	out := make(chan WatchEvent)
	go func() {
		defer close(out)
		defer func() {
			c.mu.Lock()
			delete(c.view.watchers, w)
			c.mu.Unlock()
		}()
		for {
			select {
			case ev := <-w.buf:
				if !send(ctx, out, ev) {
					return
				}
			case <-w.lost:
				for {
					select {
					case ev := <-w.buf:
						if !send(ctx, out, ev) {
							return
						}
						continue
					default:
					}
					break
				}
				send(ctx, out, WatchEvent{Err: errdefs.Unavailable("watch of %s fell behind the controller's cache: watch again", c.kind)})
				return
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}
