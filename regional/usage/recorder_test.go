package usage

import (
	"fmt"
	"slices"
	"sync"
	"testing"
)

func TestRecorderDrainSortedAndReset(t *testing.T) {
	r := NewRecorder(0)
	r.Add("r2", "b", 1, 0)
	r.Add("r1", "z", 2, 1)
	r.Add("r1", "a", 3, 0)
	r.Add("r2", "b", 4, 2)
	r.Add("r1", "a", 0, 5)
	r.Add("r1", "noop", 0, 0)  // nothing to add
	r.Add("r1", "neg", -7, -1) // negative is treated as 0
	want := []Delta{
		{"r1", "a", 3, 5},
		{"r1", "z", 2, 1},
		{"r2", "b", 5, 2},
	}
	if got := r.Drain(); !slices.Equal(got, want) {
		t.Fatalf("Drain = %v, want %v", got, want)
	}
	if got := r.Drain(); got != nil {
		t.Fatalf("second Drain = %v, want nil", got)
	}
	r.Add("r1", "a", 1, 0)
	if got := r.Drain(); !slices.Equal(got, []Delta{{"r1", "a", 1, 0}}) {
		t.Fatalf("Drain after reset = %v", got)
	}
}

func TestRecorderMaxKeys(t *testing.T) {
	r := NewRecorder(3)
	for i := range 5 {
		r.Add("r", fmt.Sprint(i), 1, 0)
	}
	r.Add("r", "0", 1, 0) // existing key: still counted
	r.Add("r", "4", 1, 0) // new key: dropped again
	got := r.Drain()
	if len(got) != 3 {
		t.Fatalf("kept %d keys, want 3: %v", len(got), got)
	}
	var sum int64
	for _, d := range got {
		sum += d.Admitted
	}
	if sum != 4 {
		t.Fatalf("kept admitted sum %d, want 4", sum)
	}
	if r.Dropped() != 3 {
		t.Fatalf("Dropped = %d, want 3", r.Dropped())
	}
	// The bound is per drain: the next interval has room again.
	for i := range 3 {
		r.Add("r", fmt.Sprint(10+i), 1, 0)
	}
	if got := r.Drain(); len(got) != 3 || r.Dropped() != 3 {
		t.Fatalf("after drain: kept %d, dropped %d", len(got), r.Dropped())
	}
}

// TestRecorderConcurrent adds from many goroutines while another drains,
// and checks that every addition is returned by exactly one Drain.
func TestRecorderConcurrent(t *testing.T) {
	const workers, perWorker, nkeys = 8, 5000, 97
	r := NewRecorder(0)
	keys := make([]string, nkeys)
	for i := range keys {
		keys[i] = fmt.Sprintf("user:%d", i)
	}
	total := map[[2]string][2]int64{}
	collect := func(ds []Delta) {
		for _, d := range ds {
			k := [2]string{d.Rule, d.Key}
			c := total[k]
			total[k] = [2]int64{c[0] + d.Admitted, c[1] + d.Rejected}
		}
	}
	stop := make(chan struct{})
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		for {
			select {
			case <-stop:
				return
			default:
				collect(r.Drain())
			}
		}
	}()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWorker {
				rule := "rule-" + fmt.Sprint(i%3)
				r.Add(rule, keys[(i*7+w)%nkeys], int64(1+i%5), int64(i%2))
			}
		}()
	}
	wg.Wait()
	close(stop)
	<-drained
	collect(r.Drain())

	want := map[[2]string][2]int64{}
	for w := range workers {
		for i := range perWorker {
			k := [2]string{"rule-" + fmt.Sprint(i%3), keys[(i*7+w)%nkeys]}
			c := want[k]
			want[k] = [2]int64{c[0] + int64(1+i%5), c[1] + int64(i%2)}
		}
	}
	if len(total) != len(want) {
		t.Fatalf("%d buckets, want %d", len(total), len(want))
	}
	for k, w := range want {
		if total[k] != w {
			t.Fatalf("bucket %v: got %v, want %v", k, total[k], w)
		}
	}
	if r.Dropped() != 0 {
		t.Fatalf("Dropped = %d", r.Dropped())
	}
}

// TestRecorderAddAllocs checks that Add on known keys, and on a key set that
// was seen in an earlier interval, does not allocate.
func TestRecorderAddAllocs(t *testing.T) {
	r := NewRecorder(0)
	keys := make([]string, 256)
	for i := range keys {
		keys[i] = fmt.Sprintf("user:%d", i)
	}
	for _, k := range keys {
		r.Add("rule", k, 1, 0)
	}
	r.Drain()
	allocs := testing.AllocsPerRun(20, func() {
		for _, k := range keys {
			r.Add("rule", k, 1, 1)
		}
		for i := range r.shards { // reset as Drain does, without Drain's output slice
			s := &r.shards[i]
			clear(s.idx)
			s.keys, s.c = s.keys[:0], s.c[:0]
		}
		r.nkeys.Store(0)
	})
	if allocs != 0 {
		t.Fatalf("Add allocates %.1f times per %d calls in steady state", allocs, len(keys))
	}
}

func BenchmarkRecorderAdd(b *testing.B) {
	for _, nkeys := range []int{1, 1000, 100_000} {
		b.Run(fmt.Sprintf("keys=%d", nkeys), func(b *testing.B) {
			keys := make([]string, nkeys)
			for i := range keys {
				keys[i] = fmt.Sprintf("user:%d", i)
			}
			r := NewRecorder(2 * nkeys)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					r.Add("global-api", keys[i%nkeys], 1, 0)
					i += 7
				}
			})
		})
	}
}
