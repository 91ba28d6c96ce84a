"""What GCP, Kubernetes, Helm and registries accept, as checks the typed spec runs before anything is registered.

Each rule is the backend's own, with where it is documented; none is a house preference.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping

# Kubernetes object names (apimachinery pkg/util/validation: IsDNS1123Label, IsDNS1035Label).
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS_LABEL_MAX = 63
# KubeRay: a RayJob's RayCluster is the job name plus a 6-character suffix and may have 53 (MaxRayJobNameLength).
RAYJOB_NAME_MAX = 47
DNS_SUBDOMAIN_MAX = 253

# GCP names that are RFC 1035 labels (Compute Engine resource names, GKE clusters and node pools, resource
# policies): https://cloud.google.com/compute/docs/naming-resources#resource-name-format
GCP_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
GKE_CLUSTER_NAME_MAX = 40  # gcloud container clusters create: "must be 1-40 characters"
GKE_NODE_POOL_NAME_MAX = 40
# IAM service account ids: 6-30 characters (https://cloud.google.com/iam/docs/service-accounts-create).
SERVICE_ACCOUNT_ID = re.compile(r"^[a-z]([-a-z0-9]{4,28}[a-z0-9])$")
# Cloud Storage bucket names: 3-63 characters of a-z, 0-9, '-', '_', '.', starting and ending with a letter or
# digit (https://cloud.google.com/storage/docs/buckets#naming).
BUCKET_NAME = re.compile(r"^[a-z0-9][-a-z0-9_.]{1,61}[a-z0-9]$")
# The same page (read 2026-11-29): "Bucket names cannot begin with the "goog" prefix" and "cannot contain "google" or
# close misspellings, such as "g00gle"". Which misspellings it refuses is not listed; the check takes "google" with the
# look-alike digits 0 for o, 1 for l and 3 for e.
BUCKET_NAMING = "https://cloud.google.com/storage/docs/buckets#naming"
BUCKET_RESERVED_PREFIX = "goog"
BUCKET_GOOGLE_LIKE = re.compile(r"g[o0]{2}g[l1][e3]")
# Project ids "cannot contain restricted strings, such as google, null, undefined, and ssl"
# (https://cloud.google.com/resource-manager/docs/creating-managing-projects, "Project ID", read 2026-11-29; another
# revision of the page lists google and ssl as restricted and only advises against null and undefined). The stack
# deploys to a project that exists, whose id GCP accepted, so it refuses only "google", which every revision lists and
# which Cloud Storage refuses in the bucket names that embed the project id too.
PROJECT_ID_RULES = "https://cloud.google.com/resource-manager/docs/creating-managing-projects"
PROJECT_RESTRICTED = ("google",)

# Resource labels (https://cloud.google.com/resource-manager/docs/labels-overview#requirements): at most 64 per
# resource; keys 1-63 and values 0-63 characters of lowercase letters, digits, '_' and '-' (international letters
# allowed); keys start with a lowercase letter.
LABEL_KEY = re.compile(r"^[\w-]{1,63}$")
LABEL_VALUE = re.compile(r"^[\w-]{0,63}$")
MAX_LABELS = 64

# Image references, as distribution/reference (reference/regexp.go) parses them; names are at most 255 characters.
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = f"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_NAME = rf"(?:{_HOST}(?::[0-9]+)?/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(rf"^(?P<name>{_NAME})(?::{_TAG})?(?:@{_DIGEST})?$")
IMAGE_TAG = re.compile(rf"^{_TAG}$")
IMAGE_NAME_MAX = 255

# Helm chart versions are SemVer 2 (https://helm.sh/docs/topics/charts/#charts-and-versioning; semver.org's regex).
SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$")

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # Kueue WorkloadPriorityClass.value is an int32

# VPC subnet ranges: IPv4 prefixes /8 to /29, and never these (https://cloud.google.com/vpc/docs/subnets,
# "Valid IPv4 ranges" and "Prohibited IPv4 subnet ranges").
SUBNET_PREFIX_MIN, SUBNET_PREFIX_MAX = 8, 29
PROHIBITED_RANGES = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "255.255.255.255/32"))
# A private cluster's control plane takes a /28 (GKE private clusters: master-ipv4-cidr "must be a /28").
CONTROL_PLANE_PREFIX = 28


def dns_label(value: str, max_len: int = DNS_LABEL_MAX, what: str = "a Kubernetes name (DNS-1123 label)") -> str:
    if len(value) > max_len or not DNS1123_LABEL.match(value):
        raise ValueError(f"{value!r} is not {what}: at most {max_len} characters of a-z, 0-9 and '-', starting and "
                         "ending with a letter or digit")
    return value


def dns_subdomain(value: str) -> str:
    if len(value) > DNS_SUBDOMAIN_MAX or not DNS1123_SUBDOMAIN.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes object name (DNS-1123 subdomain): lowercase a-z, 0-9, '-' "
                         "and '.', starting and ending with a letter or digit, at most 253 characters")
    return value


def gcp_name(value: str, max_len: int, what: str) -> str:
    if len(value) > max_len or not GCP_NAME.match(value):
        raise ValueError(f"{what} {value!r} is not a valid GCP name: at most {max_len} characters of a-z, 0-9 "
                         "and '-', starting with a letter and not ending with '-'")
    return value


def bucket_reserved_word(part: str, *, first: bool) -> str | None:
    """The rule a part of a bucket name breaks by itself (`first`: the part the name begins with), or None."""
    if first and part.startswith(BUCKET_RESERVED_PREFIX):
        return f"bucket names cannot begin with {BUCKET_RESERVED_PREFIX!r}"
    m = BUCKET_GOOGLE_LIKE.search(part)
    if m:
        spelled = "" if m.group() == "google" else f" (here {m.group()!r})"
        return f"bucket names cannot contain 'google' or a close misspelling such as 'g00gle'{spelled}"
    return None


def project_restricted(value: str) -> str | None:
    """The restricted string a project id contains, or None."""
    return next((w for w in PROJECT_RESTRICTED if w in value), None)


def labels(values: Mapping[str, str]) -> dict[str, str]:
    if len(values) > MAX_LABELS:
        raise ValueError(f"{len(values)} labels; GCP allows at most {MAX_LABELS} per resource")
    for key, value in values.items():
        if (not isinstance(key, str) or not LABEL_KEY.match(key) or key != key.lower()
                or not (key[0].islower() and key[0].isalpha())):
            raise ValueError(f"label key {key!r}: GCP label keys are 1-63 lowercase letters, digits, '_' or '-', "
                             "starting with a lowercase letter")
        if not isinstance(value, str) or not LABEL_VALUE.match(value) or value != value.lower():
            raise ValueError(f"label {key!r}: value {value!r} is not a GCP label value (at most 63 lowercase "
                             "letters, digits, '_' or '-')")
    return dict(values)


def image_reference(value: str) -> str:
    m = IMAGE_REFERENCE.match(value)
    if not m:
        raise ValueError(f"{value!r} is not a container image reference like "
                         "us-docker.pkg.dev/project/repo/trainer:tag or ...@sha256:<digest>")
    if len(m.group("name")) > IMAGE_NAME_MAX:
        raise ValueError(f"image name {m.group('name')[:40]!r}... is longer than {IMAGE_NAME_MAX} characters")
    return value


def image_tag(value: str) -> str:
    if not IMAGE_TAG.match(value):
        raise ValueError(f"{value!r} is not an image tag: 1-128 letters, digits, '_', '.' or '-', not starting "
                         "with '.' or '-'")
    return value


def semver(value: str) -> str:
    if not SEMVER.match(value):
        raise ValueError(f"{value!r} is not a chart version: Helm charts use SemVer 2, like 0.19.2")
    return value


def subnet_range(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> None:
    if network.version != 4:
        raise ValueError(f"{network} is not an IPv4 range (the stack's subnets are IPv4)")
    if not SUBNET_PREFIX_MIN <= network.prefixlen <= SUBNET_PREFIX_MAX:
        raise ValueError(f"{network}: VPC subnet ranges are /{SUBNET_PREFIX_MIN} to /{SUBNET_PREFIX_MAX}")
    allowed_in_vpc(network)


def allowed_in_vpc(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> None:
    bad = next((p for p in PROHIBITED_RANGES if network.overlaps(p)), None)
    if bad is not None:
        raise ValueError(f"{network} overlaps {bad}, which GCP does not allow in a VPC")


def overlaps(ranges: Iterable[tuple[str, str]]) -> list[tuple[str, str, str, str]]:
    """(key a, cidr a, key b, cidr b) for each pair of named ranges that overlap."""
    items = [(k, ipaddress.ip_network(c)) for k, c in ranges]
    return [(ka, str(a), kb, str(b)) for i, (ka, a) in enumerate(items) for kb, b in items[i + 1:] if a.overlaps(b)]


# Compute Engine keeps four addresses of every subnet's primary range (network, gateway, second-to-last, broadcast:
# cloud.google.com/vpc/docs/subnets, "Reserved IP addresses in IPv4 subnets").
SUBNET_RESERVED_ADDRESSES = 4
# GKE gives every node a pod range of twice its maximum pods, rounded up to a power of two: a /24 for the default of
# 110 pods per node, which the stack keeps (cloud.google.com/kubernetes-engine/docs/how-to/flexible-pod-cidr).
POD_RANGE_PER_NODE_PREFIX = 24


def nodes_in_subnet(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> int:
    """How many nodes (one primary address each) a subnet's primary range holds."""
    return network.num_addresses - SUBNET_RESERVED_ADDRESSES


def nodes_in_pod_range(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> int:
    """How many nodes' pod ranges a cluster's pod range holds."""
    return 2 ** max(0, POD_RANGE_PER_NODE_PREFIX - network.prefixlen)
