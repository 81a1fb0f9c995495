package cli

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	agelib "filippo.io/age"
	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

func (a *app) backupCommand() *cobra.Command {
	var (
		file       string
		recipients []string
		recFiles   []string
	)
	cmd := &cobra.Command{
		Use:   "backup -o FILE --recipient age1...",
		Short: "Save an encrypted backup of the whole controller",
		Long: `Save a backup of the whole controller: every resource and sealed secret
(the CA, the clusters' CAs and kubeconfigs, bootstrap tokens, BMC
passwords), read at one etcd revision, and the sealing key that opens them.

The controller encrypts the backup with age (https://age-encryption.org) to
the recipients given, before it leaves the controller: the file is safe at
rest, and only the holder of a recipient's identity can restore it, with
kiln-controller restore --from FILE --identity KEYFILE --data-dir DIR.
Make a key pair with kilnctl backup keygen. Only an admin may take a
backup. The file is written atomically (mode 0600): a failed backup leaves
no file behind.`,
		Example: `  kilnctl backup keygen -o backup.key          # prints the public key: age1...
  kilnctl backup -o kiln-$(date +%F).kbak --recipient age1...
  kiln-controller restore --from kiln-2026-12-03.kbak --identity backup.key --data-dir /var/lib/kiln-controller`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if file == "" {
				return errdefs.InvalidArgument("backup: -o FILE is required")
			}
			for _, f := range recFiles {
				rs, err := readRecipientFile(f)
				if err != nil {
					return err
				}
				recipients = append(recipients, rs...)
			}
			if len(recipients) == 0 {
				return errdefs.InvalidArgument("backup: no recipient: pass --recipient age1... (kilnctl backup keygen -o FILE makes a key pair and prints its public key)")
			}
			for _, r := range recipients {
				if _, err := agelib.ParseX25519Recipient(r); err != nil {
					return errdefs.InvalidArgument("backup: --recipient %q is not an age X25519 public key (age1...): %v", r, err)
				}
			}
			if _, err := a.client(cmd.Context()); err != nil {
				return err
			}
			stream, err := controllerv1.NewMaintenanceClient(a.conn).Backup(cmd.Context(), &controllerv1.BackupRequest{Recipients: recipients})
			if err != nil {
				return a.rpcError("backup", err)
			}
			var size int64
			var last *controllerv1.BackupChunk
			// The file appears (mode 0600) only once the whole backup is
			// on disk; an error of receive is the command's error as it is.
			var recvErr error
			receive := func(w io.Writer) error {
				for {
					ch, err := stream.Recv()
					if errors.Is(err, io.EOF) {
						break
					}
					if err != nil {
						return a.rpcError("backup", err)
					}
					if _, err := w.Write(ch.GetData()); err != nil {
						return fmt.Errorf("backup: write %s: %w", file, err)
					}
					size += int64(len(ch.GetData()))
					last = ch
				}
				if last == nil || last.GetRevision() == 0 {
					return errdefs.Unavailable("backup: the controller ended the backup before its end: nothing was written; run it again")
				}
				return nil
			}
			if err := atomicfile.WriteFunc(file, 0o600, func(w io.Writer) error {
				recvErr = receive(w)
				return recvErr
			}); err != nil {
				if recvErr != nil {
					return recvErr
				}
				return fmt.Errorf("backup: %w", err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s: %d keys at etcd revision %d, %d bytes, encrypted to %d recipient(s)\n",
				file, last.GetKeys(), last.GetRevision(), size, len(recipients))
			return nil
		},
	}
	cmd.Flags().StringVarP(&file, "output", "o", "", "backup file to write (mode 0600)")
	cmd.Flags().StringArrayVar(&recipients, "recipient", nil, "age public key (age1...) that may open the backup; repeatable")
	cmd.Flags().StringArrayVar(&recFiles, "recipients-file", nil, "file of age public keys, one per line (# comments); repeatable")
	cmd.AddCommand(backupKeygenCommand())
	return cmd
}

func backupKeygenCommand() *cobra.Command {
	var file string
	cmd := &cobra.Command{
		Use:   "keygen -o FILE",
		Short: "Make an age key pair for backups: writes the identity, prints the public key",
		Long: `Make an age X25519 key pair for backups. The identity (the private key)
is written to FILE with mode 0600 and is what kiln-controller restore needs;
keep it away from the controller, somewhere a restore can reach it. The
public key (age1...) is printed: give it to kilnctl backup --recipient.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if file == "" {
				return errdefs.InvalidArgument("backup keygen: -o FILE is required")
			}
			id, err := agelib.GenerateX25519Identity()
			if err != nil {
				return err
			}
			f, err := os.OpenFile(file, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
			if err != nil {
				return fmt.Errorf("backup keygen: %w (it never overwrites a key)", err)
			}
			_, werr := fmt.Fprintf(f, "# Kiln backup identity; public key: %s\n%s\n", id.Recipient(), id)
			if err := errors.Join(werr, f.Sync(), f.Close()); err != nil {
				os.Remove(file)
				return fmt.Errorf("backup keygen: %w", err)
			}
			fmt.Fprintln(cmd.OutOrStdout(), id.Recipient().String())
			return nil
		},
	}
	cmd.Flags().StringVarP(&file, "output", "o", "", "identity file to write (mode 0600, never overwritten)")
	return cmd
}

func readRecipientFile(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("backup: --recipients-file: %w", err)
	}
	defer f.Close()
	var rs []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		rs = append(rs, line)
	}
	return rs, sc.Err()
}
