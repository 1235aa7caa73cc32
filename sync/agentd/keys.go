package agentd

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/sync/wire"
)

// ImageUser is the uid and gid of the apportion container image's user
// (deploy/Dockerfile): "syncagent keys" run as root gives it the seeds.
const ImageUser = 10001

// keysInit is "syncagent keys DIR REGION...": it creates, once, what the
// regions' agents need to sign and verify reports, and keeps what exists:
//
//	DIR/<region>.nk         the region's NKey user seed (mode 0600), for
//	                        --report-seed-file and --nats-nkey
//	DIR/peers               region=PUBLICKEY of every region, for --report-peer-keys @DIR/peers
//	DIR/nats-<region>.conf  SYNCAGENT_NKEY, included by deploy/nats/<region>.conf
//
// Run as root, it gives the seeds to ImageUser. It prints the peers list.
func keysInit(args []string, stdout, stderr io.Writer) error {
	const help = "usage: syncagent keys DIR REGION... (creates the missing report keys of the regions in DIR)"
	args, done, err := subcommandArgs("keys", help, args, stderr)
	if done || err != nil {
		return err
	}
	if len(args) < 2 {
		return errors.New(help)
	}
	dir, regions := args[0], args[1:]
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("keys: %w", err)
	}
	var peers strings.Builder
	for _, r := range regions {
		if err := usage.ValidRegion(r); err != nil {
			return fmt.Errorf("keys: region %q: %w", r, err)
		}
		path := filepath.Join(dir, r+".nk")
		seed, err := os.ReadFile(path)
		if errors.Is(err, os.ErrNotExist) {
			if seed, _, err = wire.GenerateSeed(); err == nil {
				err = writeNew(path, append(seed, '\n'), 0o600)
			}
		}
		if err != nil {
			return fmt.Errorf("keys: %s: %w", r, err)
		}
		s, err := wire.NewSigner(r, seed)
		if err != nil {
			return fmt.Errorf("keys: %s: %w", path, err)
		}
		if os.Geteuid() == 0 {
			if err := os.Chown(path, ImageUser, ImageUser); err != nil {
				return fmt.Errorf("keys: %w", err)
			}
		}
		if err := writeFile(filepath.Join(dir, "nats-"+r+".conf"), fmt.Sprintf("SYNCAGENT_NKEY: %q\n", s.PublicKey())); err != nil {
			return err
		}
		fmt.Fprintf(&peers, "%s=%s\n", r, s.PublicKey())
	}
	if err := writeFile(filepath.Join(dir, "peers"), peers.String()); err != nil {
		return err
	}
	_, err = io.WriteString(stdout, peers.String())
	return err
}

// writeNew creates path with data; it fails if path exists.
func writeNew(path string, data []byte, perm os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// writeFile replaces path (mode 0644) with data, atomically.
func writeFile(path, data string) error {
	tmp := path + ".new"
	if err := os.WriteFile(tmp, []byte(data), 0o644); err != nil {
		return fmt.Errorf("keys: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("keys: %w", err)
	}
	return nil
}
