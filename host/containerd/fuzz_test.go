package containerd

import (
	"reflect"
	"testing"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// FuzzConfigEdit edits containerd config files of any content the way
// the agent's preflight does (ParseConfig, SetSystemdCgroup, Encode).
// Properties:
//   - a file ParseConfig accepts encodes, and parses back to the same
//     tree (nothing the parser accepts is lost or fails to serialise);
//   - after SetSystemdCgroup(v) the encoded file reads back
//     SystemdCgroup = v, set, at the same version, and every other value
//     is unchanged;
//   - refusals are InvalidArgument or NotSupported.
func FuzzConfigEdit(f *testing.F) {
	for _, s := range []string{
		debianConfig, v3Config, "", "version = 2\n",
		"version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\nSystemdCgroup = true\n",
		"version = 3\n[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.runc.options]\nSystemdCgroup = \"yes\"\n",
		"[plugins.cri.containerd.runtimes.runc]\nruntime_type = \"io.containerd.runc.v2\"\n",
		"version = 2\n[plugins]\n\"io.containerd.grpc.v1.cri\" = 5\n",
		"version = 9\n", "version = 2.0\nx = 1979-05-27T07:32:00Z\ny = [1, 'a', {b = 2}]\n",
	} {
		f.Add([]byte(s), true)
	}
	f.Fuzz(func(t *testing.T, data []byte, want bool) {
		c, err := ParseConfig(data)
		if err != nil {
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("ParseConfig(%q) = %v, want InvalidArgument", data, err)
			}
			return
		}
		out, err := c.Encode()
		if err != nil {
			t.Fatalf("ParseConfig accepted %q but Encode fails: %v", data, err)
		}
		back, err := ParseConfig(out)
		if err != nil {
			t.Fatalf("ParseConfig(Encode(ParseConfig(%q))) = %v\n%s", data, err, out)
		}
		if !reflect.DeepEqual(back.tree, c.tree) {
			t.Fatalf("Encode loses values of %q:\nencoded %s\nbefore %#v\nafter %#v", data, out, c.tree, back.tree)
		}

		version := c.Version()
		if err := c.SetSystemdCgroup(want); err != nil {
			if !errdefs.IsInvalidArgument(err) && !errdefs.IsNotSupported(err) {
				t.Fatalf("SetSystemdCgroup(%v) on %q = %v, want InvalidArgument or NotSupported", want, data, err)
			}
			return
		}
		out, err = c.Encode()
		if err != nil {
			t.Fatalf("Encode after SetSystemdCgroup(%v) on %q: %v", want, data, err)
		}
		edited, err := ParseConfig(out)
		if err != nil {
			t.Fatalf("the edited %q does not parse: %v\n%s", data, err, out)
		}
		if edited.Version() != version {
			t.Fatalf("the edit changed version %d to %d", version, edited.Version())
		}
		v, set, err := edited.SystemdCgroup()
		if err != nil || !set || v != want {
			t.Fatalf("SystemdCgroup() after SetSystemdCgroup(%v) on %q = %v, %v, %v\n%s", want, data, v, set, err, out)
		}
		// Everything else is as it was: undo the edit on a fresh parse of
		// the input and compare.
		orig, _ := ParseConfig(data)
		p, _ := RuncOptionsPath(version)
		opts, _ := lookup(edited.tree, p)
		delete(opts, "SystemdCgroup")
		if opts, ok := lookup(orig.tree, p); ok {
			delete(opts, "SystemdCgroup")
		}
		prune(edited.tree, orig.tree)
		if !reflect.DeepEqual(edited.tree, orig.tree) {
			t.Fatalf("SetSystemdCgroup changed other values of %q:\n%s", data, out)
		}
	})
}

// prune removes from got the tables (and runtime_type) the edit created
// that want lacks.
func prune(got, want map[string]any) {
	for k, v := range got {
		w, ok := want[k]
		gm, isMap := v.(map[string]any)
		switch {
		case !ok && isMap:
			prune(gm, map[string]any{})
			if len(gm) == 0 {
				delete(got, k)
			}
		case !ok && k == "runtime_type" && v == RuncRuntimeType:
			delete(got, k)
		case isMap:
			if wm, ok := w.(map[string]any); ok {
				prune(gm, wm)
			}
		}
	}
}
