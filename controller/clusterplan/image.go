package clusterplan

import (
	"fmt"
	"sort"
	"strings"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Condition type and reasons of image resolution on ControlPlane and
// MachineDeployment status.
const (
	// ConditionImageResolved is True when the Image new machines get
	// exists (spec.image) or one matches spec.imageSelector.
	ConditionImageResolved = "ImageResolved"

	ReasonImageNotFound        = "ImageNotFound"
	ReasonNoImageMatches       = "NoImageMatchesSelector"
	ReasonImageVersionMismatch = "ImageVersionMismatch"
	ReasonImageResolved        = "Resolved"
)

// imageRef is how a ControlPlane or MachineDeployment names its image:
// by name (spec.image) or by labels (spec.imageSelector).
type imageRef struct {
	name     string
	selector map[string]string
}

func (r imageRef) empty() bool { return r.name == "" && len(r.selector) == 0 }

// resolution is an imageRef resolved against the Images that exist.
type resolution struct {
	// image is the Image new machines get; "" when none (see reason).
	image string
	// reason and msg say why image is "" (or, for a version mismatch, why
	// it may not be used); both "" when resolved.
	reason, msg string
	// want names what was asked for, for messages: spec.image, or the
	// selector ("os=debian12,kubernetes=v1.34.4").
	want string
	// upToDate says whether a machine laid with the named image needs no
	// rollout for its image.
	upToDate func(image string) bool
}

// blocked reports whether an image is asked for and none may be used:
// no machine can be created (nor rolled out) until one is.
func (r resolution) blocked() bool { return r.reason != "" }

// resolveImage resolves ref for Kubernetes version. By name, the Image
// must exist; by selector, the newest matching Image wins: the highest
// patch level, then build date, then name. Either way an Image whose
// kubernetesVersion differs from version is refused. A machine is up to
// date by name when it has that image; by selector when its image still
// matches the selector (or no longer exists: deleting an Image rolls
// nothing), so a newer Image never rolls a running cluster.
func resolveImage(ref imageRef, version string, images []*typesv1.Image) resolution {
	byName := make(map[string]*typesv1.Image, len(images))
	for _, img := range images {
		byName[img.GetMetadata().GetName()] = img
	}
	r := resolution{upToDate: func(string) bool { return true }, want: ref.name}
	if ref.name == "" && len(ref.selector) > 0 {
		r.want = "the newest image with labels " + selectorString(ref.selector)
	}
	switch {
	case ref.empty():
		return r
	case ref.name != "":
		r.upToDate = func(image string) bool { return image == ref.name }
		img, ok := byName[ref.name]
		if !ok {
			r.reason = ReasonImageNotFound
			r.msg = fmt.Sprintf("image %s not found; %s; or name images by label with imageSelector (docs/clusters.md)", ref.name, listImages(images))
			return r
		}
		return checkVersion(r, img, version)
	}
	r.upToDate = func(image string) bool {
		img, ok := byName[image]
		return !ok || matches(img.GetMetadata().GetLabels(), ref.selector)
	}
	var match []*typesv1.Image
	for _, img := range images {
		if img.GetMetadata().GetDeletionTimestamp() == nil && matches(img.GetMetadata().GetLabels(), ref.selector) {
			match = append(match, img)
		}
	}
	if len(match) == 0 {
		r.reason = ReasonNoImageMatches
		r.msg = fmt.Sprintf("no image has labels %s; %s", selectorString(ref.selector), listImages(images))
		return r
	}
	sort.Slice(match, func(i, j int) bool { return newer(match[i], match[j]) })
	return checkVersion(r, match[0], version)
}

func checkVersion(r resolution, img *typesv1.Image, version string) resolution {
	name := img.GetMetadata().GetName()
	if iv := img.GetSpec().GetKubernetesVersion(); iv != "" && version != "" && iv != version {
		r.reason = ReasonImageVersionMismatch
		r.msg = fmt.Sprintf("image %s holds Kubernetes %s but the version is %s: name an image built for %s (kilnctl get images)", name, iv, version, version)
		return r
	}
	r.image = name
	return r
}

// newer orders a before b when a is the newer image.
func newer(a, b *typesv1.Image) bool {
	as, bs := a.GetSpec(), b.GetSpec()
	if as.GetPatchLevel() != bs.GetPatchLevel() {
		return as.GetPatchLevel() > bs.GetPatchLevel()
	}
	if as.GetBuildDate() != bs.GetBuildDate() {
		return as.GetBuildDate() > bs.GetBuildDate()
	}
	return a.GetMetadata().GetName() > b.GetMetadata().GetName()
}

// listImages says which images exist, for messages: "kilnctl get images
// lists 2: a, b".
func listImages(images []*typesv1.Image) string {
	if len(images) == 0 {
		return "kilnctl get images lists none: build one (kiln-imagebuilder build) and kilnctl apply its .image.yaml"
	}
	names := make([]string, 0, len(images))
	for _, img := range images {
		n := img.GetMetadata().GetName()
		if l := img.GetMetadata().GetLabels(); len(l) > 0 {
			n += " (" + selectorString(l) + ")"
		}
		names = append(names, n)
	}
	sort.Strings(names)
	const max = 5
	more := ""
	if len(names) > max {
		more = fmt.Sprintf(", and %d more", len(names)-max)
		names = names[:max]
	}
	return fmt.Sprintf("kilnctl get images lists %d: %s%s", len(images), strings.Join(names, ", "), more)
}

// setImageCondition records res as the ImageResolved condition (none when
// no image is asked for).
func setImageCondition(set func(t, st, reason, msg string), ref imageRef, res resolution) {
	switch {
	case ref.empty():
	case res.blocked():
		set(ConditionImageResolved, conditions.False, res.reason, res.msg)
	case ref.name != "":
		set(ConditionImageResolved, conditions.True, ReasonImageResolved, "image "+res.image)
	default:
		set(ConditionImageResolved, conditions.True, ReasonImageResolved, fmt.Sprintf("image %s: the newest with labels %s", res.image, selectorString(ref.selector)))
	}
}
