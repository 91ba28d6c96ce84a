"""The service's store: Cloud SQL for PostgreSQL on a private IP in the environment's VPC, reached only through the
Cloud SQL connectors with IAM database authentication as the API's and the engine's own Google service accounts. No
built-in database user and no password exist anywhere."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from envspec.config import EnvironmentSpec
from infra.components.iam import after_pool, workload_principal
from infra.components.storage import CHECKPOINT_ROLE, READER_ROLE
from trainer.service.store import CLOUDSQL_OWNER_ROLE as OWNER_ROLE
from workloads.service import engine_on_host_network

SERVICE_NETWORKING = "servicenetworking.googleapis.com"
# What the Cloud SQL Python Connector needs on the instance (roles/cloudsql.client: cloudsql.instances.connect and
# .get, for the instance's address and an ephemeral client certificate) and what IAM database login needs
# (roles/cloudsql.instanceUser: cloudsql.instances.login).
CONNECTOR_ROLES = ("roles/cloudsql.client", "roles/cloudsql.instanceUser")
WORKLOAD_IDENTITY_USER = "roles/iam.workloadIdentityUser"
# OWNER_ROLE (imported above from the store, which sets it before it creates or alters tables) is the PostgreSQL role
# the IAM users are granted (see ServiceDatabase for why), so that both users own what either creates.
IAM_AUTH_FLAG = "cloudsql.iam_authentication"
# Cloud SQL Enterprise edition keeps transaction logs for point-in-time recovery 1 to 7 days (pulumi-gcp 10.2
# DatabaseInstanceSettingsBackupConfigurationArgs.transaction_log_retention_days: "from 1-7"; 35 only on Enterprise
# Plus), so PITR covers at most the last 7 days even when more daily backups are kept.
MAX_LOG_RETENTION_DAYS = 7
BACKUP_START = "03:00"  # UTC; Cloud SQL starts the daily backup within four hours of it
MAINTENANCE_DAY, MAINTENANCE_HOUR = 7, 4  # Sunday 04:00 UTC, after the backup window
# The IAM database user of a service account is its e-mail without this suffix (PostgreSQL's 63-byte role names;
# Cloud SQL docs "Add an IAM user or service account to a database", and pulumi-gcp sql.ProvisionScript's example).
SA_SUFFIX = ".gserviceaccount.com"


@dataclass(frozen=True)
class ServiceDatabaseArgs:
    spec: EnvironmentSpec
    network: pulumi.Input[str]  # the environment's VPC (its id): private services access and the private IP
    project_number: pulumi.Input[str]  # the KSA principals' pool is named by the project's number
    # The cluster: its creation creates the workload identity pool the bindings below name (iam.after_pool).
    cluster: pulumi.Resource
    # The checkpoint bucket's name; pass the Storage component's bucket.name so the engine's grant waits for the
    # bucket. The spec's name (the same string, no dependency) when unset.
    bucket: pulumi.Input[str] | None = None
    state_bucket: pulumi.Input[str] | None = None  # the same for the service's state bucket


def iam_user_name(email: str) -> str:
    """The Cloud SQL IAM database user of a Google service account (PostgreSQL): its e-mail minus the suffix."""
    return email.removesuffix(SA_SUFFIX)


def instance_condition(project: str, instance: str) -> str:
    """An IAM condition that limits a project-level Cloud SQL grant to one instance. Cloud SQL has no IAM policy on
    an instance (pulumi-gcp has no sql IAM member resource), so a project binding with this condition is as narrow
    as GCP allows: the expression of Google's own sample for Cloud SQL IAM Conditions
    (terraform-google-modules/terraform-docs-samples cloud_sql/instance_iam_condition/main.tf, region tag
    cloud_sql_instance_iam_conditions, which https://cloud.google.com/sql/docs/postgres/iam-conditions shows)."""
    return (f"resource.name == 'projects/{project}/instances/{instance}' && "
            "resource.type == 'sqladmin.googleapis.com/Instance'")


class ServiceDatabase(pulumi.ComponentResource):
    connection_name: pulumi.Output[str]  # PROJECT:REGION:INSTANCE, what the connector dials
    database: str
    accounts: dict[str, pulumi.Output[str]]  # "api" / "engine" -> Google service account e-mail
    users: dict[str, pulumi.Output[str]]  # "api" / "engine" -> IAM database user name
    owner_role: str  # the role the store SETs before DDL (OWNER_ROLE)
    instance: gcp.sql.DatabaseInstance

    def __init__(self, name: str, args: ServiceDatabaseArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        spec = args.spec
        svc = spec.service
        if svc is None:
            raise ValueError(f"environment {spec.env!r} has no service section: no database to create")
        super().__init__("gke-tpu-rl:infra:ServiceDatabase", name, None, opts)
        db = svc.database
        protected = spec.sql_protected
        child = pulumi.ResourceOptions(parent=self)
        in_pool = after_pool(self, args.cluster)  # a member named in the cluster's workload identity pool
        # Protected: `pulumi destroy` leaves the instance, its database and the private range it lives in, as
        # infra/components/storage.py leaves a protected bucket; deletion protection also refuses deletion by any
        # other means.
        kept = pulumi.ResourceOptions(parent=self, retain_on_delete=protected)

        # Private services access: a range of the VPC reserved for Google's service producers and the peering to
        # them; Cloud SQL's private IP comes from it. Here rather than in infra/components/network.py: only an
        # environment with a service needs it, and its range is service.database.privateServiceCidr (checked against
        # every other range of the environment by the spec).
        cidr = ipaddress.ip_network(db.private_service_cidr)
        psa_range = gcp.compute.GlobalAddress(
            f"{name}-psa-range", name=f"{spec.cluster_name}-{svc.name}-psa", project=spec.project,
            purpose="VPC_PEERING", address_type="INTERNAL", address=str(cidr.network_address),
            prefix_length=cidr.prefixlen, network=args.network,
            description=f"private services access (Cloud SQL) of {spec.cluster_name}", opts=kept)
        # Cloud SQL keeps using the peering for a while after its instance is deleted (so that it can be restored),
        # and the API then refuses to delete the connection ("Producer services ... are still using this
        # connection", hashicorp/terraform-provider-google#16275). REMOVE_PEERING (pulumi-gcp 10.2
        # servicenetworking.Connection deletion_policy) removes the VPC peering instead, so the VPC can be deleted.
        psa = gcp.servicenetworking.Connection(
            f"{name}-psa", network=args.network, service=SERVICE_NETWORKING,
            reserved_peering_ranges=[psa_range.name], deletion_policy="REMOVE_PEERING", opts=kept)

        self.instance = gcp.sql.DatabaseInstance(
            f"{name}-instance",
            name=spec.sql_instance_name,
            project=spec.project,
            region=spec.region,
            database_version=db.version,
            # Pulumi's own guard; settings.deletion_protection_enabled below is GCP's, on every surface.
            deletion_protection=protected,
            settings=gcp.sql.DatabaseInstanceSettingsArgs(
                # PostgreSQL 16+ defaults to Enterprise Plus, which takes no db-custom tier (pulumi-gcp 10.2
                # DatabaseInstanceSettingsArgs.edition).
                edition="ENTERPRISE",
                tier=db.tier,
                availability_type=db.availability.upper(),
                # The cluster's zone: the API and engine pods talk to it without crossing zones.
                location_preference=gcp.sql.DatabaseInstanceSettingsLocationPreferenceArgs(zone=spec.zone),
                disk_type="PD_SSD",
                disk_size=db.disk_gb,
                disk_autoresize=True,
                deletion_protection_enabled=protected,
                ip_configuration=gcp.sql.DatabaseInstanceSettingsIpConfigurationArgs(
                    ipv4_enabled=False,  # no public IP: reachable from the VPC only
                    private_network=args.network,
                    allocated_ip_range=psa_range.name,
                    # The connector opens TLS (with an ephemeral client certificate); nothing unencrypted.
                    ssl_mode="ENCRYPTED_ONLY",
                ),
                # Only the Cloud SQL connectors and Auth Proxy may connect (the store uses the Python connector),
                # never a direct connection from elsewhere in the VPC; and no ExecuteSql API, which would reach a
                # private-IP instance from the internet (pulumi-gcp 10.2 settings.data_api_access).
                connector_enforcement="REQUIRED",
                data_api_access="DISALLOW_DATA_API",
                database_flags=[gcp.sql.DatabaseInstanceSettingsDatabaseFlagArgs(name=IAM_AUTH_FLAG, value="on")],
                backup_configuration=gcp.sql.DatabaseInstanceSettingsBackupConfigurationArgs(
                    enabled=True,
                    start_time=BACKUP_START,
                    point_in_time_recovery_enabled=True,
                    transaction_log_retention_days=min(db.backup_retention_days, MAX_LOG_RETENTION_DAYS),
                    # One automated backup a day: keeping N backups keeps N days.
                    backup_retention_settings=gcp.sql.DatabaseInstanceSettingsBackupConfigurationBackupRetentionSettingsArgs(
                        retained_backups=db.backup_retention_days, retention_unit="COUNT"),
                ),
                maintenance_window=gcp.sql.DatabaseInstanceSettingsMaintenanceWindowArgs(
                    day=MAINTENANCE_DAY, hour=MAINTENANCE_HOUR, update_track="stable"),
                user_labels=spec.resource_labels(),
            ),
            # Autoresize grows the disk; without this the next `up` would try to set it back to disk_gb, which
            # replaces the instance (pulumi-gcp 10.2 DatabaseInstanceSettingsArgs.disk_size).
            opts=pulumi.ResourceOptions.merge(kept, pulumi.ResourceOptions(
                depends_on=[psa], ignore_changes=["settings.diskSize"])),
        )
        self.database = svc.name
        gcp.sql.Database(f"{name}-db", name=self.database, instance=self.instance.name, project=spec.project,
                         opts=kept)

        # The API's and the engine's Google service accounts: Cloud SQL IAM database users must be Google
        # identities, so the Kubernetes service accounts (queues.namespace / <service>-api, <service>-engine) act as
        # these through workload identity.
        ksas = {"api": spec.service_api_name, "engine": spec.service_engine_name}
        condition = self.instance.name.apply(lambda instance: instance_condition(spec.project, instance))
        self.accounts, self.users = {}, {}
        for role, account_id in spec.service_gcp_accounts.items():
            gsa = gcp.serviceaccount.Account(
                f"{name}-{role}", project=spec.project, account_id=account_id,
                display_name=f"{svc.name} {role} of {spec.cluster_name}", opts=child)
            member = pulumi.Output.concat("serviceAccount:", gsa.email)
            gcp.serviceaccount.IAMMember(
                f"{name}-{role}-workload-identity", service_account_id=gsa.id, role=WORKLOAD_IDENTITY_USER,
                member=f"serviceAccount:{spec.project}.svc.id.goog[{spec.queues.namespace}/{ksas[role]}]",
                opts=in_pool)
            for grant in CONNECTOR_ROLES:
                gcp.projects.IAMMember(
                    f"{name}-{role}-{grant.split('.')[-1].lower()}", project=spec.project, role=grant, member=member,
                    condition=gcp.projects.IAMMemberConditionArgs(
                        title=f"only {spec.sql_instance_name}"[:100],
                        description=f"the {svc.name} {role}'s store: one Cloud SQL instance",
                        expression=condition),
                    opts=child)
            # Privileges in the database. Cloud SQL gives a new IAM user none ("When an IAM user is added to a
            # database instance, that new user is granted no privileges on any databases, by default": Cloud SQL
            # docs, Manage users with IAM database authentication), and PostgreSQL 15+ grants CREATE on schema
            # public to the database owner only (pg_database_owner; PostgreSQL 15 release notes), which for a
            # database made through the Cloud SQL API is cloudsqlsuperuser. With no built-in user and no password
            # there is nobody to run GRANT, so the grant is the user's database_roles (pulumi-gcp 10.2 sql.User:
            # "predefined Cloud SQL roles, like cloudsqlsuperuser, or your own custom roles", the latter needing a
            # CREATE ROLE first, which again needs someone logged in). Both users get it because both processes
            # create and migrate the schema (trainer/service/store/schema.py create_schema: "the API and the engine
            # processes may start at the same moment"). A table belongs to whoever created it and other members of
            # cloudsqlsuperuser cannot use it, so the store must `SET ROLE cloudsqlsuperuser` (OWNER_ROLE) before its
            # DDL: then every table is the shared role's and both users can read, write and migrate it. Broader than
            # the store needs (cloudsqlsuperuser may create roles and databases on this one instance), which a custom
            # role made by a provision script would narrow at the cost of a login for the deployer and the ExecuteSql
            # API on the instance.
            user = gcp.sql.User(
                f"{name}-{role}-db-user", instance=self.instance.name, project=spec.project,
                name=gsa.email.apply(iam_user_name), type="CLOUD_IAM_SERVICE_ACCOUNT",
                database_roles=[OWNER_ROLE],
                # A PostgreSQL user that was granted roles cannot be deleted through the API (pulumi-gcp 10.2
                # sql.User deletion_policy): destroy leaves it to the instance.
                deletion_policy="ABANDON",
                opts=child)
            self.accounts[role] = gsa.email
            self.users[role] = user.name
            if role == "api":
                # The API's pods serve external weights downloads from the engine's storage dir, through their own
                # read-only GCS FUSE mount of the checkpoint bucket (workloads/service.py api_checkpoint_mount): read
                # only (objects.get and .list, which the CSI driver's access check needs on the whole bucket,
                # gcs-fuse-csi-driver pkg/cloud_provider/storage/storage.go CheckBucketExists), and nothing on the
                # state bucket. They run on the pod network (the system pool), where the driver acts as the account
                # the KSA names (token_sources.go fetchGCPSAToken): this one, so no KSA principal is needed. Created
                # before the API's Deployment, which waits for this component (infra/components/program.py), so its
                # pods' mount is granted when they start; as the engine's grant, a child without the pool's dependency.
                gcp.storage.BucketIAMMember(
                    f"{name}-api-object-viewer", bucket=args.bucket or spec.bucket_name, role=READER_ROLE,
                    member=member, opts=child)
            if role == "engine":
                # The engine's pods read and write the users' adapters and optimizer state in the checkpoint bucket,
                # and each model's snapshot in the state bucket (service.state_dir), through GCS FUSE; the API only
                # reads the checkpoint bucket (above). Who GCS sees depends on the pod's network. On the pod network
                # the CSI driver impersonates the account its KSA names (gcs-fuse-csi-driver pkg/cloud_provider/auth/
                # token_sources.go fetchGCPSAToken): this one. On the host network (a multi-host slice without
                # DRANET) the sidecar uses the KSA's own federated token and impersonates nobody (Token(): "if
                # fetchTokenfromFile is set ... we skip the check"): the KSA's principal. The staging Job runs on
                # the pod network, so the account is granted always, the principal where the engine needs it.
                members = {"": member}
                if engine_on_host_network(spec):
                    members["-ksa"] = workload_principal(args.project_number, spec.project, spec.queues.namespace,
                                                         ksas[role])
                for suffix, who in members.items():
                    grant_opts = in_pool if suffix else child
                    gcp.storage.BucketIAMMember(
                        f"{name}-engine{suffix}-object-user", bucket=args.bucket or spec.bucket_name,
                        role=CHECKPOINT_ROLE, member=who, opts=grant_opts)
                    gcp.storage.BucketIAMMember(
                        f"{name}-engine{suffix}-state-user", bucket=args.state_bucket or spec.service_state_bucket,
                        role=CHECKPOINT_ROLE, member=who, opts=grant_opts)
        self.owner_role = OWNER_ROLE
        # What the connector dials; built from the inputs so it is known at preview (Cloud SQL's connectionName).
        self.connection_name = pulumi.Output.concat(spec.project, ":", spec.region, ":", self.instance.name)
        self.register_outputs({"connection_name": self.connection_name, "database": self.database,
                               "accounts": self.accounts, "users": self.users})
