package sim

// Bucket is a token bucket in the integer arithmetic of the enforcer's Redis
// script (regional/redisstore.Model, which the tests hold it to): capacity and
// rate in thousandths of a token (per second), tokens in millionths, time in
// whole milliseconds of the store's clock. Elapsed time below zero counts as
// zero, so a clock step back never mints tokens. The zero Bucket has no state:
// its first use starts it full, as a missing Redis key does.
type Bucket struct {
	Tokens int64 // millionths of a token; may be negative only after Debit
	Last   int64 // store ms of the last refill
	Cap    int64 // thousandths of a token
	Rate   int64 // thousandths of a token per second (= millionths per ms)
	Units  int64 // the share units the parameters were computed from (callers' use)
	Init   bool
	// A fixed window (W > 0, ms of the store's clock; kept by Start): N
	// requests admitted in window Wi, admitted while (N + cost) * 1000 <=
	// Cap, the store script's global fixed window. Rate is unused.
	W, Wi, N int64
}

// roll starts the window of ms if it is later than the bucket's (a time
// before it reads as the bucket's window, as in the script).
func (b *Bucket) roll(ms int64) {
	if wi := floorDivMs(ms, b.W); wi > b.Wi {
		b.Wi, b.N = wi, 0
	}
}

func floorDivMs(a, b int64) int64 {
	q := a / b
	if a%b != 0 && a < 0 {
		q--
	}
	return q
}

// Used is a fixed window's count in the window of ms.
func (b *Bucket) Used(ms int64) int64 {
	b.roll(ms)
	return b.N
}

func ceilDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) == (b < 0) {
		q++
	}
	return q
}

// Start gives an empty bucket its parameters and fills it.
func (b *Bucket) Start(ms, capM, rateM int64) {
	*b = Bucket{Tokens: capM * 1000, Last: ms, Cap: capM, Rate: rateM, Init: true, Units: b.Units, W: b.W}
	if b.W > 0 {
		b.Wi = floorDivMs(ms, b.W)
	}
}

// Refill brings the bucket to ms at its current rate.
func (b *Bucket) Refill(ms int64) {
	if b.W > 0 {
		b.roll(ms)
		return
	}
	capU := b.Cap * 1000
	t := min(b.Tokens, capU)
	el := max(ms-b.Last, 0)
	if b.Rate > 0 && t < capU {
		if el >= ceilDiv(capU-t, b.Rate) {
			t = capU
		} else {
			t += el * b.Rate
		}
	}
	b.Tokens, b.Last = t, ms
}

// Take refills and takes cost whole tokens if they are there. Like the
// script, a rejection writes nothing unless the clock is behind the bucket's
// time (then the bucket takes the clock's time as its own).
func (b *Bucket) Take(ms, cost int64) bool {
	if b.W > 0 {
		b.roll(ms)
		if (b.N+cost)*1000 > b.Cap {
			return false
		}
		b.N += cost
		return true
	}
	tokens, last := b.Tokens, b.Last
	b.Refill(ms)
	c := cost * 1_000_000
	if c > b.Tokens {
		if ms >= last {
			b.Tokens, b.Last = tokens, last
		}
		return false
	}
	b.Tokens -= c
	return true
}

// Debit removes cost tokens whether or not they are there (the bucket goes
// into debt): the async strategy's way of applying other regions' usage.
func (b *Bucket) Debit(ms, cost int64) {
	if b.W > 0 {
		b.roll(ms)
		b.N += cost
		return
	}
	b.Refill(ms)
	b.Tokens -= cost * 1_000_000
}

// Set settles the bucket at its old rate up to ms, then sets the new
// capacity and rate and clamps the tokens: the share-change script.
func (b *Bucket) Set(ms, capM, rateM int64) {
	if b.W > 0 {
		b.roll(ms)
		b.Cap, b.Rate = capM, rateM
		return
	}
	b.Refill(ms)
	b.Cap, b.Rate = capM, rateM
	b.Tokens = min(b.Tokens, capM*1000)
}
