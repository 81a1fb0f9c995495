package cli

import (
	"strings"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// kind is a resource kind as kilnctl names it on the command line.
type kind struct {
	Name    string   // "ControlPlane": what the API takes
	Aliases []string // "controlplane", "controlplanes", "cp"
}

// kinds in the order `kilnctl get` documents them.
var kinds = []kind{
	{"Host", []string{"host", "hosts"}},
	{"Image", []string{"image", "images", "img"}},
	{"Cluster", []string{"cluster", "clusters"}},
	{"ControlPlane", []string{"controlplane", "controlplanes", "cp"}},
	{"MachineDeployment", []string{"machinedeployment", "machinedeployments", "md"}},
	{"Machine", []string{"machine", "machines", "m"}},
	{"HealthCheck", []string{"healthcheck", "healthchecks", "hc"}},
	{"ClusterClass", []string{"clusterclass", "clusterclasses", "cc"}},
	{"Rollout", []string{"rollout", "rollouts", "ro"}},
	{"GitSource", []string{"gitsource", "gitsources", "gs"}},
}

// lookupKind resolves a kind as typed (singular, plural or short name, any
// case). An unknown kind is InvalidArgument naming the accepted names.
func lookupKind(s string) (kind, error) {
	l := strings.ToLower(s)
	for _, k := range kinds {
		if l == strings.ToLower(k.Name) {
			return k, nil
		}
		for _, a := range k.Aliases {
			if l == a {
				return k, nil
			}
		}
	}
	return kind{}, errdefs.InvalidArgument("unknown kind %q: use one of %s", s, kindList())
}

func kindList() string {
	var names []string
	for _, k := range kinds {
		n := k.Aliases[1]
		if len(k.Aliases) > 2 {
			n += " (" + k.Aliases[2] + ")"
		}
		names = append(names, n)
	}
	return strings.Join(names, ", ")
}

// lower is the kind as it prefixes names in output: "controlplane/lab-cp".
func (k kind) lower() string { return strings.ToLower(k.Name) }

// kindArgs completes the KIND argument.
func kindArgs() []string {
	var out []string
	for _, k := range kinds {
		out = append(out, k.Aliases[1])
	}
	return out
}

// completeKindName completes KIND, then NAME from the controller (when a
// config is at hand; errors complete nothing).
func (a *app) completeKindName(cmd *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
	if len(args) == 0 {
		return kindArgs(), cobra.ShellCompDirectiveNoFileComp
	}
	if len(args) > 1 && cmd.Name() != "delete" {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	k, err := lookupKind(args[0])
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	c, err := a.client(cmd.Context())
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	ctx, cancel := a.call(cmd.Context())
	defer cancel()
	resp, err := c.List(ctx, &controllerv1.ListRequest{Kind: k.Name, Limit: 500})
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	names := make([]string, 0, len(resp.GetItems()))
	for _, r := range resp.GetItems() {
		names = append(names, metaOf(r).GetName())
	}
	return names, cobra.ShellCompDirectiveNoFileComp
}
