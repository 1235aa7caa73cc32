package rules

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"reflect"
	"sync"
	"sync/atomic"
	"time"
)

// Log keys used by this package.
const (
	logKeyPath  = "path"
	logKeyErr   = "err"
	logKeyRule  = "rule"
	logKeyField = "field"
	logKeyItem  = "item"
	logKeyRules = "rules"
)

// DefaultPollInterval is how often a FileSource looks at its file.
const DefaultPollInterval = time.Second

// racyWindow: a file read less than this long after its modification time
// may be written again without a visible change of mtime and size (coarse
// file system timestamps), so the source reads it again on the next poll.
const racyWindow = 2 * time.Second

// FileSource is a Source that reads a rules file (JSON or YAML, see
// ParseRules) and polls it for changes. A change is seen by modification
// time, size and SHA-256 of the content. A file that fails to parse is logged
// with the field that is wrong, counted in Failures, and ignored: the last
// good set stays.
type FileSource struct {
	path     string
	interval time.Duration
	log      *slog.Logger

	failures atomic.Uint64
	reloads  atomic.Uint64
	mu       sync.Mutex
	lastErr  error // guarded by mu
}

// FileOption configures a FileSource.
type FileOption func(*FileSource) error

// WithPollInterval sets how often the file is checked for changes.
// Default 1s (DefaultPollInterval); it must be above 0.
func WithPollInterval(d time.Duration) FileOption {
	return func(s *FileSource) error {
		if d <= 0 {
			return fmt.Errorf("rules: poll interval must be above 0, got %s", d)
		}
		s.interval = d
		return nil
	}
}

// WithLogger sets the logger for reloads and reload failures.
// Default slog.Default().
func WithLogger(l *slog.Logger) FileOption {
	return func(s *FileSource) error {
		if l == nil {
			return errors.New("rules: nil logger")
		}
		s.log = l
		return nil
	}
}

// NewFileSource returns a source for the rules file at path. It does not
// read the file; Run does.
func NewFileSource(path string, opts ...FileOption) (*FileSource, error) {
	if path == "" {
		return nil, errors.New("rules: empty rules file path")
	}
	s := &FileSource{path: path, interval: DefaultPollInterval, log: slog.Default()}
	for _, o := range opts {
		if err := o(s); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// Failures is the number of failed loads so far (the initial one included):
// each distinct bad content, and each time the file became unreadable,
// counts once.
func (s *FileSource) Failures() uint64 { return s.failures.Load() }

// Reloads is the number of rule sets delivered after the first one.
func (s *FileSource) Reloads() uint64 { return s.reloads.Load() }

// LastError is the error of the latest load, or nil when it succeeded.
func (s *FileSource) LastError() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastErr
}

// fileVersion identifies what the source last read.
type fileVersion struct {
	mod    time.Time
	size   int64
	readAt time.Time
	sum    [sha256.Size]byte
	broken string // the stat or read error, when the file could not be read
}

// Run loads the file and calls update with its rules; an initial failure is
// returned, so that a process refuses to start with a bad file. Run then
// polls the file and calls update with each new valid set that differs from
// the current one, until ctx is done, and returns nil. update is called from
// the goroutine that called Run.
func (s *FileSource) Run(ctx context.Context, update func([]Rule)) error {
	var seen fileVersion
	cur, err := s.load(&seen)
	if err != nil {
		s.fail(err)
		return err
	}
	s.setErr(nil)
	s.log.Info("rules loaded", logKeyPath, s.path, logKeyRules, len(cur))
	update(cur)

	t := time.NewTicker(s.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if rs, changed := s.poll(&seen, cur); changed {
			cur = rs
			s.reloads.Add(1)
			update(cur)
		}
	}
}

// poll checks the file once. It returns the new set when the file holds a
// valid set that differs from cur.
func (s *FileSource) poll(seen *fileVersion, cur []Rule) ([]Rule, bool) {
	fi, err := os.Stat(s.path)
	if err != nil {
		if seen.broken != err.Error() {
			seen.broken = err.Error()
			s.fail(err)
			s.log.Error("rules file unreadable; keeping the last good rules", logKeyPath, s.path, logKeyErr, err)
		}
		return nil, false
	}
	if seen.broken == "" && fi.ModTime().Equal(seen.mod) && fi.Size() == seen.size && seen.readAt.Sub(seen.mod) >= racyWindow {
		return nil, false
	}
	prev := *seen
	rs, err := s.load(seen)
	if seen.broken != "" { // could not stat or read it
		if seen.broken != prev.broken {
			s.fail(err)
			s.log.Error("rules file unreadable; keeping the last good rules", logKeyPath, s.path, logKeyErr, err)
		}
		return nil, false
	}
	if prev.broken == "" && seen.sum == prev.sum {
		return nil, false // same content as last time (good or bad): nothing new to say
	}
	if err != nil {
		s.fail(err)
		attrs := []any{logKeyPath, s.path, logKeyErr, err}
		var fe *FieldError
		if errors.As(err, &fe) {
			attrs = append(attrs, logKeyRule, fe.RuleID, logKeyField, fe.Field, logKeyItem, fe.Item)
		}
		s.log.Error("rules file invalid; keeping the last good rules", attrs...)
		return nil, false
	}
	s.setErr(nil)
	if reflect.DeepEqual(rs, cur) {
		s.log.Debug("rules file changed, rules did not", logKeyPath, s.path)
		return nil, false
	}
	s.log.Info("rules reloaded", logKeyPath, s.path, logKeyRules, len(rs))
	return rs, true
}

// load reads and parses the file, recording what it read in v.
func (s *FileSource) load(v *fileVersion) ([]Rule, error) {
	fi, err := os.Stat(s.path)
	if err != nil {
		v.broken = err.Error()
		return nil, fmt.Errorf("rules: %w", err)
	}
	data, err := readLimited(s.path)
	if err != nil {
		v.broken = err.Error()
		return nil, err
	}
	*v = fileVersion{mod: fi.ModTime(), size: fi.Size(), readAt: time.Now(), sum: sha256.Sum256(data)}
	if int64(len(data)) != fi.Size() {
		v.size = -1 // changed while we read it: look again next time
	}
	rs, err := ParseRules(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", s.path, err)
	}
	return rs, nil
}

func (s *FileSource) fail(err error) {
	s.failures.Add(1)
	s.setErr(err)
}

func (s *FileSource) setErr(err error) {
	s.mu.Lock()
	s.lastErr = err
	s.mu.Unlock()
}

// StaticSource is a Source with a fixed rule set, for tests and for embedding.
type StaticSource []Rule

// Run normalizes and validates the rules (an invalid rule or a duplicate id
// is returned as the error), calls update once with them, and waits for ctx
// to be done; it then returns nil.
func (s StaticSource) Run(ctx context.Context, update func([]Rule)) error {
	rs := make([]Rule, len(s))
	ids := make(map[string]int, len(s))
	for i := range s {
		r := s[i].Clone()
		r.Normalize()
		if err := r.Validate(); err != nil {
			return err
		}
		if prev, dup := ids[r.ID]; dup {
			return &FieldError{RuleID: r.ID, Item: i + 1, Field: "id", Msg: fmt.Sprintf("duplicate id, also used by item %d", prev)}
		}
		ids[r.ID] = i + 1
		rs[i] = r
	}
	update(rs)
	<-ctx.Done()
	return nil
}
