package scenario

import (
	"math"
	"time"
)

// LevelAt returns the demand's level (multiple of rule.rate) at time t.
func (d *Demand) LevelAt(t time.Duration) float64 {
	switch d.Shape {
	case "steps":
		v := 0.0
		for _, s := range d.Steps {
			if t >= s.At.D() {
				v = s.Level
			}
		}
		return v
	case "ramp":
		switch {
		case t <= d.Start.D():
			return d.From
		case t >= d.End.D():
			return d.To
		}
		x := float64(t-d.Start.D()) / float64(d.End-d.Start)
		return d.From + (d.To-d.From)*x
	case "sinusoid":
		v := d.Level + d.Amplitude*math.Sin(2*math.Pi*float64(t+d.Phase.D())/float64(d.Period))
		return math.Max(0, v)
	}
	return d.Level
}

// Peak returns the highest level the demand reaches (the simulator draws
// Poisson arrivals at it and thins them to the level of the moment).
func (d *Demand) Peak() float64 {
	switch d.Shape {
	case "steps":
		v := 0.0
		for _, s := range d.Steps {
			v = math.Max(v, s.Level)
		}
		return v
	case "ramp":
		return math.Max(d.From, d.To)
	case "sinusoid":
		return d.Level + math.Abs(d.Amplitude)
	}
	return d.Level
}

// Changes returns the times in (0, until) at which the demand changes in a
// step (the starts of steps), for convergence measurements.
func (d *Demand) Changes() []time.Duration {
	var out []time.Duration
	if d.Shape == "steps" {
		for _, s := range d.Steps {
			if s.At > 0 {
				out = append(out, s.At.D())
			}
		}
	}
	return out
}

// Fractions returns the part of the stream each region sends, in region order.
func (sc *Scenario) Fractions(d *Demand) []float64 {
	out := make([]float64, len(sc.Regions))
	if d.Region != "" {
		out[sc.Index(d.Region)] = 1
		return out
	}
	for k, v := range d.Split {
		out[sc.Index(k)] = v
	}
	return out
}
