package manifest

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// addExamples seeds f with every resource file in examples/ and the
// documents the other tests of this package decode.
func addExamples(f *testing.F) {
	files, err := filepath.Glob("../../examples/*.yaml")
	if err != nil || len(files) == 0 {
		f.Fatalf("no examples to seed from: %v", err)
	}
	for _, p := range files {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte(goodCluster))
	f.Add([]byte(hostsYAML(3)))
	f.Add([]byte("apiVersion: kiln.dev/v1\nkind: Host\nmetadata: {name: a}\nspec: &s {bmc: {protocol: none}}\n---\napiVersion: kiln.dev/v1\nkind: Host\nmetadata: {name: b}\nspec: *s\n"))
	f.Add([]byte("kind: MachineDeployment\napiVersion: kiln.dev/v1\nmetadata: {name: w}\nspec: {cluster: c, replicas: 2, strategy: {maxSurge: 1, maxUnavailable: 25%}}\nstatus: {replicas: 1}\n"))
}

// FuzzDecode feeds arbitrary bytes to Decode, as kilnctl apply -f does
// with an operator's file. Properties:
//   - a refusal is an *Error of class InvalidArgument whose problems each
//     name the file, and never a panic;
//   - whatever Decode accepts, Marshal writes and Decode reads back equal
//     (so `kilnctl get -o yaml` output applies again), and the same for
//     MarshalJSON;
//   - validation of an accepted document either passes or reports
//     problems at lines inside the file.
func FuzzDecode(f *testing.F) {
	addExamples(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		docs, err := Decode("in.yaml", data)
		if err != nil {
			var derr *Error
			if !errors.As(err, &derr) || !errdefs.IsInvalidArgument(err) {
				t.Fatalf("Decode error %T %v, want *manifest.Error of class InvalidArgument", err, err)
			}
			if len(derr.Problems) == 0 {
				t.Fatalf("Decode returned an *Error without problems")
			}
			for _, p := range derr.Problems {
				if p.File != "in.yaml" {
					t.Errorf("problem %q names file %q, want in.yaml", p, p.File)
				}
			}
			return
		}
		lines := strings.Count(string(data), "\n") + 1
		for _, d := range docs {
			if d.Resource == nil {
				t.Fatalf("Decode returned a document without a resource")
			}
			var errs Error
			if checkDocument == nil {
				t.Fatal("checkDocument is unset: load_test.go's init sets it")
			}
			checkDocument(d, &errs)
			for _, p := range errs.Problems {
				if p.Line < 1 || p.Line > lines {
					t.Errorf("validation problem %q at line %d, outside the file's %d lines", p, p.Line, lines)
				}
			}

			y, err := Marshal(d.Resource)
			if err != nil {
				t.Fatalf("Marshal(%v) of a decoded document: %v", d.Resource, err)
			}
			back, err := Decode("out.yaml", y)
			if err != nil {
				t.Fatalf("Decode(Marshal(%v)): %v\n%s", d.Resource, err, y)
			}
			if len(back) != 1 || !proto.Equal(back[0].Resource, d.Resource) {
				t.Fatalf("Decode(Marshal(x)) != x\nx = %v\nyaml:\n%s", d.Resource, y)
			}
			j, err := MarshalJSON(d.Resource)
			if err != nil {
				t.Fatalf("MarshalJSON(%v) of a decoded document: %v", d.Resource, err)
			}
			back, err = Decode("out.json", j)
			if err != nil {
				t.Fatalf("Decode(MarshalJSON(%v)): %v\n%s", d.Resource, err, j)
			}
			if len(back) != 1 || !proto.Equal(back[0].Resource, d.Resource) {
				t.Fatalf("Decode(MarshalJSON(x)) != x\nx = %v\njson:\n%s", d.Resource, j)
			}
		}
	})
}
