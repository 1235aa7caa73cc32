package stack

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/apportion/apportion/sync/wire"
)

// writeKeys generates a report signing seed per region in Dir/keys
// (<region>.nk, mode 0600) and the list of every region's public key
// (Dir/keys/peers), so that the stack's agents sign and verify their
// reports as in production.
func (s *Stack) writeKeys(names []string) error {
	dir := filepath.Join(s.Dir, "keys")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	var peers strings.Builder
	for _, n := range names {
		seed, pub, err := wire.GenerateSeed()
		if err != nil {
			return fmt.Errorf("stack: report key of %s: %w", n, err)
		}
		if err := os.WriteFile(s.seedFile(n), append(seed, '\n'), 0o600); err != nil {
			return err
		}
		fmt.Fprintf(&peers, "%s=%s\n", n, pub)
	}
	return os.WriteFile(s.peersFile(), []byte(peers.String()), 0o644)
}

func (s *Stack) seedFile(region string) string { return filepath.Join(s.Dir, "keys", region+".nk") }

func (s *Stack) peersFile() string { return filepath.Join(s.Dir, "keys", "peers") }
